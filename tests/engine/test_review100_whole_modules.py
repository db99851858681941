"""Hundredth hostile review: names the scan of dpclip's code does not list, reached by torch's
own Python inside a reduction. An Embedding over 130 positions (more than the Gram rule's 128:
the direct segment-sum rule) computes ``uniq // vocab`` inside ghost's reduction, after the check
at its entry; ``//`` is ``Tensor.__floordiv__``, whose Python looks ``torch.floor_divide`` up, a
name no scan listed. A forward that set it to a one-shot wrapper swapping examples 0 and 1 in the
result had example 0 (loss x100) clipped with example 1's norm: LOO **648.1 C** under ghost and
auto (46 times the bound through make_private); ``torch.functional._unique_impl``, which a
closure of ``torch.unique``'s calls, the same.

Now every entry of the watched modules' dictionaries is compared (and of the modules whose
globals the watched functions and their closures' functions read), not only the names listed:
a callable replaced, added or removed there inside the step is refused and put back (torch's own
flags, plain values, may change; submodules and operator packets may be added by the import
system and torch.ops)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups
from dpclip.engine.errors import UnsupportedModelError

C = 1.0
V, T, B = 10, 130, 6


def _swap_01(got):
    return torch.where(got == 0, 1, torch.where(got == 1, 0, got))


class _Emb(nn.Module):
    def __init__(self, owner, name) -> None:
        super().__init__()
        self.e = nn.Embedding(V, 2)
        self.owner, self.name = owner, name
        self.armed = False

    def forward(self, x):
        out = self.e(x).sum(1)
        if self.armed:
            owner, name = self.owner, self.name
            real = vars(owner)[name]

            def once(*args, **kwargs):
                got = real(*args, **kwargs)
                setattr(owner, name, real)
                if isinstance(got, tuple):  # (_unique_impl: the keys example * V + id first)
                    e = got[0] // V
                    keys = torch.where(e < 2, (1 - e) * V + got[0] % V, got[0])
                    return (keys,) + tuple(got[1:])
                return _swap_01(got)
            setattr(owner, name, once)
        return out


def _loss(out, y):
    return (out * y.unsqueeze(1)).sum(1)


TARGETS = {"torch.floor_divide": (torch, "floor_divide"),
           "torch.functional._unique_impl": (torch.functional, "_unique_impl")}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("engine", [GhostEngine, lambda: AutoEngine(compiled=False)],
                         ids=["ghost", "auto"])
def test_a_name_torch_looks_up_inside_a_reduction_is_watched(engine, target):
    owner, name = TARGETS[target]
    real = vars(owner)[name]
    torch.manual_seed(0)
    model = _Emb(owner, name)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.full((B,), 0.001)
    y[0] = 100.0
    eng = engine()
    groups = ParamGroups.flat(model)

    def weights(n):
        return torch.clamp(C / n, max=1.0)

    try:
        for step in range(4):
            model.armed = step >= 2
            try:
                full = eng.compute(model, _loss, x, y, weights, groups)
            except UnsupportedModelError as exc:
                assert model.armed and "during the private step" in str(exc)
                assert vars(owner)[name] is real  # (put back)
                continue
            model.armed = False
            rest = eng.compute(model, _loss, x[1:], y[1:], weights, groups)
            loo = math.sqrt(sum(float(((full.grads[n].double() - rest.grads[n].double()) ** 2)
                                      .sum()) for n in full.grads))
            assert loo <= C * (1 + 1e-5), (step, loo)
    finally:
        setattr(owner, name, real)


def test_torch_s_own_flags_and_lazy_entries_are_not_refused():
    """Plain values torch rebinds (an export's ``_is_exporting_flag``), submodules imported and
    operator packets made by ``torch.ops`` inside the step are the library's own."""
    from dpclip.engine import torch_names

    assert torch_names._flags(False, True) and torch_names._flags(None, 3)
    assert not torch_names._flags(None, len) and not torch_names._flags(len, True)
    assert torch_names._submodule(torch, "nn", torch.nn)
    assert not torch_names._submodule(torch, "evil", torch.nn)
    packet = torch.ops.aten.mm
    assert torch_names._submodule(torch.ops.aten, "mm", packet)
    assert not torch_names._submodule(torch.ops.aten, "addmm", packet)
