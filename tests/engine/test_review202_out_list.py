"""Hostile review 202: the memory watch compared, before an operation, the tensors among its
positional arguments (and in their lists) and those passed directly as keywords, not those in a
keyword's list: ``torch.unbind_copy(src, 0, out=[K[0], K[1]])`` (or ``split_copy``) writes ``K``,
and the refresh after that accepted write took in bytes of ``K`` written unseen before (a value
chosen by the whole batch, dispatch off, the version counter set back): 14.0 C under ghost and
auto. The tensors of a keyword's list are compared too now."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from tests.engine.helpers import TRACED_ENGINES, assert_refused_or_bounded
from tests.engine.test_compiled_chains import Text, _ce, _text


class OutList(nn.Module):
    def __init__(self, d, op="unbind_copy", forge=True):
        super().__init__()
        self.op, self.forge = op, forge
        self.l2 = nn.Linear(d, d)

    def forward(self, h):
        out = self.l2(h)
        d = h.shape[-1]
        real = not isinstance(h, torch._subclasses.FakeTensor)
        k = torch.zeros(3, d, dtype=h.dtype)
        k.mul_(1.0)  # (a matched write: k is named by this operation's output)
        if real and self.forge:
            with torch._C.DisableTorchFunction(), _disable_current_modes(), torch.no_grad():
                v = k._version
                s = 1000.0 if int((h[:, 0, 0] > 0).sum()) % 2 else -1000.0
                k[2].fill_(s)
                torch._C._autograd._unsafe_set_version_counter((k,), (v,))
        src = torch.ones(2, d, dtype=h.dtype)
        if self.op == "unbind_copy":
            torch.unbind_copy(src, 0, out=[k[0], k[1]])
        else:
            torch.split_copy(src, 1, 0, out=[k[0:1], k[1:2]])
        if real:  # (the match counts one bump per written tensor; the run made none)
            torch._C._autograd._unsafe_set_version_counter((k,), (k._version + 2,))
        return out * (1 + k[2].sum())


@pytest.mark.parametrize("op", ["unbind_copy", "split_copy"])
@pytest.mark.parametrize("engine", TRACED_ENGINES)
def test_an_unseen_write_before_a_write_through_a_keyword_list_is_refused(op, engine):
    x, y = _text(b=16)
    assert_refused_or_bounded(engine, lambda: Text(lambda d: OutList(d, op)), x, y, 0.01, _ce,
                              refusal=("by no operation the trace sees",))


@pytest.mark.parametrize("op", ["unbind_copy", "split_copy"])
def test_a_write_through_a_keyword_list_alone_still_runs(op):
    x, y = _text(b=16)
    assert_refused_or_bounded("ghost", lambda: Text(lambda d: OutList(d, op, forge=False)), x, y,
                              0.01, _ce, refusal=("\\0never",))
