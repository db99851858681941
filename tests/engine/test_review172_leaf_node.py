"""Hundred-and-seventy-second hostile review: a tensor the forward made a leaf
(``torch.ones_like(z).requires_grad_()``, a leaf in the proof's run too) was given a node by a
hidden in-place write (torch's function and dispatch off: ``detach_``, a fill with +-1000 by the
sign of example 0's first feature, ``mul_(z)``, its bytes and version counter put back). The
match records a matched output's node only when it requires grad at the next operation (a
constant does not), so the forged node was never compared: 13.6 C under ghost, auto's traced pass
(a profile function set, or a model its compiled path refuses) and make_private. Now a tensor
that requires grad, is not a view and has no record must carry the node its stamp took (or none,
a leaf); the inputs' and a known chain's output's nodes are recorded where the match starts."""

import pytest
import torch
from torch import nn

from dpclip.engine import get_engine
from tests.engine.helpers import TRACED_ENGINES, assert_refused_or_bounded, loo_distance
from tests.engine.test_review137_neg_bit_dtype import C, DT, _ce, _data, _real


def _forge(h, z, x):
    with torch._C.DisableTorchFunction():
        guard = torch._C._DisableTorchDispatch()
        try:
            k = 1000.0 if bool(x[0, 0] > 0) else -1000.0
            ver = h._version
            keep = h.detach().clone()
            h.detach_()
            with torch.no_grad():
                h.fill_(k)
            h.mul_(z)
            with torch.no_grad():
                h.copy_(keep)
            torch._C._autograd._unsafe_set_version_counter((h,), (ver,))
        finally:
            del guard


class _Model(nn.Module):
    def __init__(self, forge=True, setter=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = nn.Linear(4, 6).to(DT), nn.Linear(6, 3).to(DT)
        self.forge, self.setter = forge, setter

    def forward(self, x):
        z = self.fc1(x)
        h = torch.ones_like(z)
        if self.setter:  # (the attribute's setter: one of torch's functions that returns None)
            h.requires_grad = True
        else:
            h.requires_grad_()
        if self.forge and _real(x):
            _forge(h, z, x)
        return self.fc(torch.tanh(z * h))


@pytest.mark.parametrize("setter", [False, True], ids=["requires_grad_", "setter"])
@pytest.mark.parametrize("engine", TRACED_ENGINES)
def test_a_leaf_given_a_node_unseen_is_refused_or_bounded(engine, setter):
    x, y = _data(8, "value")
    assert_refused_or_bounded(engine, lambda: _Model(setter=setter), x, y, C, _ce,
                              ("history was rewritten",))


def test_the_leaf_made_in_the_forward_is_accepted_without_the_forge():
    x, y = _data(8, "value")
    d = loo_distance(lambda: get_engine("ghost"), lambda: _Model(forge=False), x, y, C, loss=_ce)
    assert d == pytest.approx(1.0)
