"""Eighty-sixth hostile review: a forward rebinds one of torch's names that dpclip's own arithmetic
looks up when it runs, with a one-shot wrapper (it multiplies the result by 50 and puts the
original back at its first call, so nothing is changed when the step ends). Measured on a2585d2
(Linear-tanh-Linear, B 6, C 1): ``torch.mm`` LOO 3161 C under ghost (30 C on later steps), 3198 C
under compiled; ``torch.Tensor.__matmul__`` 1205 C, 30 C under vmap; ``torch.Tensor.clamp_``
(``FixedClip.weights``) 50 C under ghost and vmap.

``dpclip.engine.torch_names``: the names dpclip's code looks up in torch (from its bytecode) and
``torch.Tensor``'s dictionary are taken when the step starts and compared where user code has run;
a change is put back and the step refused. A replacement made before the step is allowed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.clipping import FixedClip
from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.test_separability_attacks import clip_weights

C = 1.0

TARGETS = {
    "torch.mm": (torch, "mm"),
    "torch.bmm": (torch, "bmm"),
    "torch.clamp": (torch, "clamp"),
    "torch.cat": (torch, "cat"),
    "Tensor.__matmul__": (torch.Tensor, "__matmul__"),
    "Tensor.clamp_": (torch.Tensor, "clamp_"),  # (inherited from the C base: a new entry)
    "Tensor.add_": (torch.Tensor, "add_"),
    # review 87: looked up by torch's own torch.autograd.grad, which the engine calls (its
    # rows of the backward rewritten: 8.89 C), and a method the engine calls on the model
    "autograd._engine_run_backward": (torch.autograd, "_engine_run_backward"),
    "Module.named_parameters": (nn.Module, "named_parameters"),
}


class _Arms(nn.Module):
    def __init__(self, target) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 2)
        self.target = target
        self.armed = False

    def forward(self, x):
        out = self.l2(torch.tanh(self.l1(x)))
        if self.armed:
            owner, name = self.target
            had = name in vars(owner)
            real = vars(owner)[name] if had else getattr(owner, name)

            def once(*args, **kwargs):
                if had:
                    setattr(owner, name, real)
                else:
                    delattr(owner, name)
                got = real(*args, **kwargs)
                if isinstance(got, tuple):  # (the backward's gradients: mixed over the batch)
                    return tuple(g + 20 * g[:1] if isinstance(g, torch.Tensor) and g.ndim
                                 else g for g in got)
                return got * 50 if isinstance(got, torch.Tensor) and got.is_floating_point() \
                    else got

            setattr(owner, name, once)
        return out


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _sum(eng, model, x, y, weight_fn):
    res = eng.compute(model, _loss, x, y, weight_fn, ParamGroups.flat(model))
    return torch.cat([g.reshape(-1) for g in res.grads.values()])


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("engine", [GhostEngine, VmapEngine, AutoEngine])
def test_a_torch_name_rebound_by_the_forward_is_refused_and_put_back(engine, target):
    owner, name = TARGETS[target]
    whole = owner in (torch.Tensor, nn.Module)
    before = dict(vars(owner)) if whole else {name: getattr(owner, name)}
    torch.manual_seed(0)
    model = _Arms(TARGETS[target])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)
    eng = engine()
    clip = FixedClip(C)

    def weights(norms):  # (dp_step's own weights: Tensor.clamp_ inside)
        return clip.weights(norms, {})

    try:
        _sum(eng, model, x, y, weights)
        model.armed = True
        try:
            full = _sum(eng, model, x, y, weights)
        except UnsupportedModelError as exc:
            assert "replaced during the private step" in str(exc)
        else:  # (an engine whose own code does not call the name: then it must stay at C,
            # the neighbour run attacked the same way)
            model.armed = True
            part = _sum(eng, model, x[1:], y[1:], weights)
            assert float((full - part).norm()) <= C * (1 + 1e-5)
        # put back: the step left torch as it found it
        if whole:
            assert vars(owner).keys() == before.keys()
            assert all(vars(owner)[k] is v for k, v in before.items())
        else:
            assert getattr(owner, name) is before[name]
    finally:
        if whole:
            for k in set(vars(owner)) - set(before):
                delattr(owner, k)
            for k, v in before.items():
                if vars(owner).get(k) is not v:
                    setattr(owner, k, v)
        else:
            setattr(owner, name, before[name])


def test_a_replacement_made_before_the_step_is_allowed():
    """A library that wraps a torch function at import (an honest pass-through) is not refused:
    only changes made inside the step are."""
    real = torch.mm
    calls = []

    def passthrough(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    torch.mm = passthrough
    try:
        got = _sum(GhostEngine(), model, x, y, clip_weights(C))
    finally:
        torch.mm = real
    want = _sum(GhostEngine(), model, x, y, clip_weights(C))
    assert calls and torch.equal(got, want)
