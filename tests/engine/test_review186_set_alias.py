"""Hostile review 186: ``aten.set_`` under ``no_grad`` gives a fresh tensor the memory of ``h`` (which
a product saved for the backward) with a version counter of its own; a write through it, still
under ``no_grad``, rewrote ``h``'s bytes while ``h``'s counter stood still, and the backward read
them: every example's gradient read example 0's rows, 4.21 C under ghost, auto and make_private
(present at 087e01d). The check of a write to the storage of a tensor with an autograd history
that is neither what the call writes nor the base of a view it writes ran with gradients on only.
Also: the schema cache of the written arguments and the name-based cache of "writes its first
argument" shared one dict, so a direct ``torch.ops.aten.set_.source_Tensor`` crashed the check
(``TypeError``) unless a first call had filled the other cache. Hostile review 188: the same alias
over a tensor autograd saved that has no history of its own (``z = h * 1.0`` under ``no_grad``,
saved by ``mul``): 3.20 C under ghost, auto and make_private (present before review 186's fix).
Hostile review 189: a check that the write moved the saved tensor's version counter was passed by
moving the counter around the write (``_unsafe_set_version_counter``), 3.24 C; no accepted write
may now reach the memory of a tensor autograd saved before the loss returns (autograd refuses such
a backward itself when the write goes through the tensor or a view of it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import (TRACED_ENGINES, assert_refused_or_bounded, clip_weights,
                                  loo_distance)
from tests.engine.test_compiled_chains import Text, _ce, _text

aten = torch.ops.aten


class SetAlias(nn.Module):
    def __init__(self, d, how="forge"):
        super().__init__()
        self.how = how
        self.l1 = nn.Linear(d, d, bias=False)
        self.l2 = nn.Linear(d, d)

    def forward(self, x):
        h = self.l1(x) + 0.0
        out = self.l2(x) * h + h  # (mul saves h for the backward)
        if self.how == "forge-warmed":  # (fills the schema cache first: the review's script)
            aten.set_.source_Tensor(torch.empty(0, dtype=x.dtype), torch.zeros(2, dtype=x.dtype))
        if self.how in ("forge", "forge-warmed"):
            a = torch.empty(0, dtype=x.dtype)
            with torch.no_grad():
                aten.set_.source_Tensor(a, h.detach())  # (h's memory, its own version counter)
                a.add_(1000 * a[:1])  # (h's bytes rewritten, h's counter unmoved)
        elif self.how == "aliased-read":  # (control) the alias only read: nothing rewritten
            with torch.no_grad():
                s = torch.zeros_like(h)
                s.add_(h.detach() * 0)
        return out


class SavedNoHistory(nn.Module):
    """Review 188: the tensor ``mul`` saves has no history of its own (made under ``no_grad``),
    so no check of histories sees a write to it; the write must move its version counter."""

    def __init__(self, d, how="forge"):
        super().__init__()
        self.how = how
        self.l2 = nn.Linear(d, d)

    def forward(self, h):
        with torch.no_grad():
            z = h * 1.0
        out = self.l2(h) * z  # (mul saves z: h requires grad)
        if self.how in ("forge", "grad-write"):
            a = torch.empty(0, dtype=z.dtype)
            with torch.no_grad():
                aten.set_.source_Tensor(a, z)
                if self.how == "forge":
                    a.add_(1000 * a[:1])
            if self.how == "grad-write":  # (the alias has no history: written with grad on)
                a.add_(1000 * a[:1])
        return out


def _set_version(t, v):
    torch._C._autograd._unsafe_set_version_counter((t,), (v,))


class CounterMovedAroundTheWrite(nn.Module):
    """Review 189: a batch-less constant ``w`` (no history) given a ``set_`` alias before ``mul``
    saves it; in the real run (the proof runs on fake tensors) ``w``'s version counter is moved
    forward around the write through the alias and set back after, so a check of the saved
    tensor's version sees it moved and the backward's unpack finds the version it packed."""

    def __init__(self, d, how="forge"):
        super().__init__()
        self.how = how
        self.l2 = nn.Linear(d, d)

    def forward(self, h):
        real = not isinstance(h, torch._subclasses.FakeTensor)
        with torch.no_grad():
            w = torch.ones(h.shape[-1], dtype=h.dtype) * 1.0
            a = torch.empty(0, dtype=h.dtype)
            aten.set_.source_Tensor(a, w)
        if real:
            _set_version(w, w._version + 1)
        out = self.l2(h) * w  # (mul saves w)
        v = w._version
        with torch.no_grad():
            r = 1000 * h[0, 0]
            if real:
                _set_version(w, v + 1)
            a.add_(r)
            if real:
                _set_version(w, v)
        return out


_FORGES = {"counter-moved-around-the-write": lambda d: CounterMovedAroundTheWrite(d),
           "forge": lambda d: SetAlias(d, "forge"),
           "forge-warmed": lambda d: SetAlias(d, "forge-warmed"),
           "saved-no-history": lambda d: SavedNoHistory(d, "forge"),
           "saved-no-history-grad-write": lambda d: SavedNoHistory(d, "grad-write")}


@pytest.mark.parametrize("how", sorted(_FORGES))
@pytest.mark.parametrize("engine", TRACED_ENGINES)
def test_a_write_through_a_set_alias_under_no_grad_is_refused_or_bounded(how, engine):
    x, y = _text(b=16)
    assert_refused_or_bounded(engine, lambda: Text(_FORGES[how]), x, y, 0.01, _ce,
                              refusal=("wrote, with gradients off", "neither what it writes",
                                       "outside torch's own functions",
                                       "without moving its version counter",
                                       "wrote the memory of a tensor autograd saved"))


def test_the_forge_is_refused_by_ghost_with_a_new_message():
    x, y = _text(b=16)
    model = Text(lambda d: SetAlias(d, "forge"))
    with pytest.raises(UnsupportedModelError,
                       match="wrote, with gradients off|wrote the memory of a tensor autograd "
                             "saved"):
        get_engine("ghost").compute(model, _ce, x, y, clip_weights(0.01),
                                    ParamGroups.flat(model))


@pytest.mark.parametrize("make", [lambda d: SetAlias(d, "plain"),
                                  lambda d: SetAlias(d, "aliased-read"),
                                  lambda d: SavedNoHistory(d, "plain")])
def test_no_grad_writes_of_the_forwards_own_tensors_still_run(make):
    x, y = _text(b=16)
    assert loo_distance(lambda: get_engine("ghost"), lambda: Text(make), x, y, 0.01,
                        loss=_ce) <= 1 + 1e-6
