"""The watched names' check by dict version tags (``dpclip.engine.torch_names._tag_offset``): a
step compares one tag per watched dictionary and the entries only where a tag moved, and reuses
the previous step's snapshot while nothing watched changed. These tests attack that shortcut: a
change must still be seen after a reused snapshot, with the tags on and off, and a dictionary
changed and put back must not be refused."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import GhostEngine, ParamGroups
from dpclip.engine import torch_names
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.test_separability_attacks import clip_weights

C = 1.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 2)
        self.action = None

    def forward(self, x):
        if self.action is not None:
            self.action()
        return self.l2(torch.tanh(self.l1(x)))


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _step(model, x, y):
    res = GhostEngine().compute(model, _loss, x, y, clip_weights(C), ParamGroups.flat(model))
    return torch.cat([g.reshape(-1) for g in res.grads.values()])


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)


@pytest.mark.skipif(sys.implementation.name != "cpython"
                    or not (3, 11) <= sys.version_info[:2] <= (3, 13),
                    reason="dict version tags are read on CPython 3.11 to 3.13 only")
def test_the_tags_are_read_here_and_move_with_every_change_of_a_watched_class():
    assert torch_names._TAG_OFFSET is not None  # (else the tests below test the fallback only)
    d = torch_names._dict_of(torch.Tensor)
    assert d is not None and set(d) == set(vars(torch.Tensor))
    (kept,), (reader,) = torch_names._tag_readers([d])
    assert kept is d
    before = reader.value
    torch.Tensor._dpclip_probe = 1
    try:
        assert reader.value != before
        mid = reader.value
    finally:
        del torch.Tensor._dpclip_probe
    assert reader.value not in (before, mid)


@pytest.mark.parametrize("tags", [True, False], ids=["tags", "no-tags"])
def test_a_change_after_reused_snapshots_is_refused_and_put_back(monkeypatch, tags):
    if not tags:
        monkeypatch.setattr(torch_names, "_TAG_OFFSET", None)
        monkeypatch.setattr(torch_names._STATE, "last", None)
    torch.manual_seed(0)
    model, (x, y) = _Net(), _data()
    want = _step(model, x, y)
    assert torch.equal(_step(model, x, y), want)  # (the first steps load modules: a new scan)
    first = torch_names._STATE.last
    assert torch.equal(_step(model, x, y), want)
    if tags:  # (nothing changed between the steps: the same snapshot)
        assert torch_names._STATE.last is first
    real = torch.Tensor.clamp_

    def scaled(self, *args, **kwargs):
        return real(self, *args, **kwargs).mul_(50)

    model.action = lambda: setattr(torch.Tensor, "clamp_", scaled)
    try:
        with pytest.raises(UnsupportedModelError, match="replaced during the private step"):
            _step(model, x, y)
        assert "clamp_" not in vars(torch.Tensor)  # (put back: inherited from the C base)
    finally:
        if "clamp_" in vars(torch.Tensor):
            del torch.Tensor.clamp_
    model.action = None
    assert torch.equal(_step(model, x, y), want)


def test_a_name_changed_and_put_back_inside_the_forward_is_not_refused():
    torch.manual_seed(0)
    model, (x, y) = _Net(), _data()
    want = _step(model, x, y)

    def back_and_forth():
        real = torch.mm
        torch.mm = lambda *a, **k: real(*a, **k)
        torch.mm = real
        torch.Tensor._dpclip_probe = 1  # (an entry not in the snapshot, added and removed)
        del torch.Tensor._dpclip_probe

    model.action = back_and_forth
    assert torch.equal(_step(model, x, y), want)
    snap = torch_names._STATE.last
    if snap is not None and snap.readers is not None:  # (the tags taken again: a fast compare)
        assert snap.tags == tuple(r.value for r in snap.readers)


def test_a_replacement_between_steps_makes_a_new_snapshot_and_is_allowed():
    torch.manual_seed(0)
    model, (x, y) = _Net(), _data()
    want = _step(model, x, y)
    first = torch_names._STATE.last
    real = torch.mm
    torch.mm = lambda *a, **k: real(*a, **k)  # (an honest wrapper, made outside every step)
    try:
        assert torch.equal(_step(model, x, y), want)
        assert torch_names._STATE.last is not first
        assert torch_names._STATE.last.values is not first.values
    finally:
        torch.mm = real
