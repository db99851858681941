"""Hundred-and-fourth hostile review: the analysis of an ATen overload (``separable._Meta``) was
read from the overload object's own attributes at its first sight and kept for the process. A
forward that set ``torch.ops.aten.relu.default._schema`` to ``flipud``'s for relu's first call ran
every later relu as a batch flip proved pointwise (LOO 5.65 C under ghost, 5.80 C under auto and
compiled; 2.44 times the bound through make_private); ``flip``'s tags and packet set to relu's
had a real batch flip proved pointwise (3.46 C).

Now an overload is checked against torch's registry at its first sight (class, schema, tags,
names, the packet ``torch.ops`` holds), everything dpclip knows about it comes from the schema's
name, and its attributes are compared by identity at every later lookup."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpclip._ident import ident
from dpclip.engine import ParamGroups, get_engine, separable
from dpclip.engine.errors import UnsupportedModelError

C = 1.0
_PLANT = [None]


def _forge_schema():
    ov = torch.ops.aten.relu.default
    saved = ov._schema
    ov._schema = torch.ops.aten.flipud.default._schema
    return ov, lambda: setattr(ov, "_schema", saved)


def _forge_tags():
    ov = torch.ops.aten.flip.default
    saved = ov._tags, ov._overloadpacket
    ov._tags, ov._overloadpacket = torch.ops.aten.relu.default._tags, torch.ops.aten.relu

    def back():
        ov._tags, ov._overloadpacket = saved
    return ov, back


class _Net(nn.Module):
    def __init__(self, flip: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)
        self.flip = flip

    def forward(self, x):
        h = self.fc1(x)
        forge, _PLANT[0] = _PLANT[0], None
        back = None
        if forge is not None:
            _, back = forge()
        try:
            h = torch.flip(h, [0]) if self.flip else torch.relu(h)
        finally:
            if back is not None:
                back()
        return self.fc2(torch.tanh(h))


def _loss(o, y):
    return ((o - y) ** 2).sum(1)


FORGERIES = {"schema": (_forge_schema, torch.ops.aten.relu.default, False),
             "tags-and-packet": (_forge_tags, torch.ops.aten.flip.default, True)}


@pytest.mark.parametrize("forgery", list(FORGERIES))
@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_a_forged_operator_at_its_first_sight_is_refused(engine, forgery):
    forge, op, flip = FORGERIES[forgery]
    separable._METAS.pop(ident(op), None)  # (its first sight is in this test)
    _PLANT[0] = forge
    torch.manual_seed(0)
    model = _Net(flip)
    x, y = torch.randn(8, 6), 10 * torch.randn(8, 3)
    x[0] *= 30
    eng = get_engine(engine)
    groups = ParamGroups.flat(model)

    def weights(n):
        return torch.clamp(C / n, max=1.0)

    try:
        for _ in range(3):
            try:
                full = eng.compute(model, _loss, x, y, weights, groups)
                rest = eng.compute(model, _loss, x[1:], y[1:], weights, groups)
            except UnsupportedModelError:
                continue
            loo = math.sqrt(sum(float(((full.grads[n].double() - rest.grads[n].double()) ** 2)
                                      .sum()) for n in full.grads))
            assert loo <= C * (1 + 1e-5), loo
    finally:
        _PLANT[0] = None
        separable._METAS.pop(ident(op), None)  # (whatever was analysed from the forgery)


def test_an_operator_changed_after_its_analysis_is_refused():
    op = torch.ops.aten.relu.default
    separable._meta(op)
    saved = op._schema
    try:
        op._schema = torch.ops.aten.flipud.default._schema
        with pytest.raises(UnsupportedModelError, match="not what torch registered"):
            separable._meta(op)
    finally:
        op._schema = saved
    assert separable._meta(op).op is not None
