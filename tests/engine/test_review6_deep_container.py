"""Sixth hostile review: a list FIVE levels deep is a channel from one call to the next under vmap.

cefbb22 snapshots a module's container attributes four levels deep
(``dpclip.engine.isolation._DEPTH``, fifth review: ``self.box[0][0]``, 3.45 C). The fifth level's
list is held by identity only, so ``self.box[0][0][0][0][0] = -3.0`` (the same five-level shape
as the fifth review's two-level one) is neither seen nor put back, and the next call under
``vmap`` reads it. Measured on cefbb22: the next call moved by 3.45 C (sound: 0), the writing
call accepted. (Borderline with the accepted-open "Python objects' internals under vmap"; filed
because the fix claims containers and a list of lists of ... is still a plain container: any
fixed depth has this hole; a recursive snapshot (with a cycle guard) or a refusal of containers
deeper than the snapshot would close it.)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT
from tests.engine.test_isolation import _first, _modes_off
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data


class _Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.box = [[[[[1.0]]]]]

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) * self.box[0][0][0][0][0]
        f, d = _modes_off()
        with f, d:
            if not is_fake(x) and _first(x) > 100:  # a marked example
                self.box[0][0][0][0][0] = -3.0
        return self.fc2(torch.tanh(h))


def test_a_five_level_list_cannot_carry_an_example_into_the_next_call_under_vmap():
    torch.manual_seed(0)
    model = _Deep().to(DT)
    x, y = data()
    got = []
    for mark in (False, True):
        model.box[0][0][0][0][0] = 1.0  # the caller's value before each sequence
        x1 = x[:2].clone()
        if mark:
            x1[0] = 30.0
        try:
            clipped_sum(VmapEngine(), model, ce, x1, y[:2])
        except UnsupportedModelError:  # refused, and (if sound) the list put back
            pass
        got.append(clipped_sum(VmapEngine(), model, ce, x[2:], y[2:])[0])
    moved = float((got[0] - got[1]).norm()) / C
    print(f"moved {moved:.3f} C")
    assert moved <= 1e-12, moved


def test_a_container_that_holds_itself_and_one_nested_too_deep():
    """The recursive snapshot enters a container that holds itself once, sees a write through
    it, and a container nested deeper than it looks always compares as changed (refused)."""
    from dpclip.engine.isolation import _DEPTH, _content, _eq, _refill

    a = [1.0]
    a.append(a)
    c = _content(a)
    assert _eq(_content(a), c)
    a[0] = 2.0
    assert not _eq(_content(a), c)
    _refill(a, c)
    assert a[0] == 1.0 and a[1] is a
    deep = cur = []
    for _ in range(_DEPTH + 2):
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    assert not _eq(_content(deep), _content(deep))
