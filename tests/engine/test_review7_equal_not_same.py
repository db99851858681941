"""Seventh hostile review: the isolation compares snapshots with ``==``, not by identity and type.

``isolation._eq`` (and ``_same_value`` for exact plain types) call an object EQUAL when it compares
``==``: ``-0.0 == 0.0``, ``1 == 1.0 == True``, a new list ``== [its copy]``, ``frozenset({(0.0,)})
== frozenset({(-0.0,)})``. A forward under ``vmap`` that swaps a value for an equal one that is
not the same (the sign of a zero, an int for a float, a copy for an alias) is neither seen nor put
back, and the next call reads the difference (``math.copysign``, ``type(..)``, ``is``): one bit per
slot, as many slots as the model has. Measured on bd7cb88: the next call moved (sound: 0).
``defaultdict`` (a dict subclass) is not snapshot at all. Now the snapshot compares item by item
by identity, builtin scalars by type and bits (``isolation._same``), and dict, list and set
subclasses are containers.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT
from tests.engine.test_isolation import _first, _modes_off
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data


def _state_float(m):  # a plain float attribute: its sign of zero
    m.s = 0.0


def _read_float(m):
    return math.copysign(1.0, m.s)


def _write_float(m):
    m.s = -0.0


def _state_list(m):  # a list item: an int for an equal float
    m.box = [1.0]


def _read_list(m):
    return -1.0 if type(m.box[0]) is int else 1.0


def _write_list(m):
    m.box[0] = 1


def _state_alias(m):  # a list held twice: one slot replaced by an equal copy
    inner = [1.0]
    m.box = [inner, inner]


def _read_alias(m):
    return 1.0 if m.box[0] is m.box[1] else -1.0


def _write_alias(m):
    m.box[1] = list(m.box[0])


def _state_set(m):  # a set of tuples: the sign of a zero inside
    m.tags = {(0.0, "a")}


def _read_set(m):
    return math.copysign(1.0, next(iter(m.tags))[0])


def _write_set(m):
    m.tags.clear()
    m.tags.add((-0.0, "a"))


def _state_key(m):  # a dict key: the sign of a zero
    m.d = {0.0: "a"}


def _read_key(m):
    return math.copysign(1.0, next(iter(m.d)))


def _write_key(m):
    m.d.clear()
    m.d[-0.0] = "a"


def _state_default(m):  # a defaultdict (a dict subclass): not snapshot at all
    m.counts = collections.defaultdict(float)
    m.counts["k"] = 0.0  # (an honest read inserts nothing)


def _read_default(m):
    return 1.0 - 2.0 * m.counts["k"]


def _write_default(m):
    m.counts["k"] = 1.0


VARIANTS = {
    "float-sign": (_state_float, _read_float, _write_float),
    "list-int-for-float": (_state_list, _read_list, _write_list),
    "alias-copy": (_state_alias, _read_alias, _write_alias),
    "set-of-tuples": (_state_set, _read_set, _write_set),
    "dict-key": (_state_key, _read_key, _write_key),
    "defaultdict": (_state_default, _read_default, _write_default),
}


class _Net(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.name = name
        VARIANTS[name][0](self)

    def forward(self, x: Tensor) -> Tensor:
        _, read, write = VARIANTS[self.name]
        h = self.fc1(x) * (2.0 + read(self))
        f, d = _modes_off()
        with f, d:
            if not is_fake(x) and _first(x) > 100:  # a marked example
                write(self)
        return self.fc2(torch.tanh(h))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_an_equal_but_other_value_cannot_carry_an_example_under_vmap(name):
    torch.manual_seed(0)
    model = _Net(name).to(DT)
    x, y = data()
    got = []
    for mark in (False, True):
        VARIANTS[name][0](model)  # the caller's value before each sequence
        x1 = x[:2].clone()
        if mark:
            x1[0] = 30.0
        try:
            clipped_sum(VmapEngine(), model, ce, x1, y[:2])
        except UnsupportedModelError:  # refused, and (if sound) put back
            pass
        got.append(clipped_sum(VmapEngine(), model, ce, x[2:], y[2:])[0])
    moved = float((got[0] - got[1]).norm()) / C
    print(f"{name}: moved {moved:.3f} C")
    assert moved <= 1e-12, moved
