"""Fifth hostile review: a list inside a list is a channel from one call to the next under vmap.

``dpclip.engine.isolation`` compares a module's container attributes by their SHALLOW content
(the items, by identity): ``self.box = [[1.0]]`` keeps the same inner list object when a call
writes ``self.box[0][0]``, so nothing is seen or put back. Under ``vmap`` (no proved-program match)
the next call reads the value. Under ghost / auto with a cached proof the match refuses it (the
scalar differs from the proof's); with a fresh proof per call (test_review5_fresh_proof.py) it
would not. Borderline with the accepted-open "Python objects' internals under vmap", but a list
of lists is a plain container of the kind the snapshot claims to cover. Now the snapshot holds the
content of containers inside containers at every depth: the write is refused and put back.
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


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.box = [[1.0]]

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) * self.box[0][0]
        f, d = _modes_off()
        with f, d:
            if not is_fake(x) and _first(x) > 100:  # a marked example
                self.box[0][0] = -3.0
        return self.fc2(torch.tanh(h))


def test_a_nested_list_cannot_carry_an_example_into_the_next_call_under_vmap():
    torch.manual_seed(0)
    model = _Nested().to(DT)
    x, y = data()
    got, refused = [], []
    for mark in (False, True):
        model.box[0][0] = 1.0  # the caller's value before each sequence
        x1 = x[:2].clone()
        if mark:
            x1[0] = 30.0
        try:
            clipped_sum(VmapEngine(), model, ce, x1, y[:2])
        except UnsupportedModelError as exc:  # refused, and the list put back
            assert "'box'" in str(exc)
            refused.append(mark)
        got.append(clipped_sum(VmapEngine(), model, ce, x[2:], y[2:])[0])
    moved = float((got[0] - got[1]).norm()) / C
    print(f"moved {moved:.3f} C")
    assert moved <= 1e-12, moved
    assert refused == [True]  # only the call that wrote it
    assert model.box == [[1.0]]
