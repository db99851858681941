"""Hundred-and-thirtieth hostile review, the direct engine API: the engines handed the model and
loss the caller's own tensors (a batch that fits one chunk and needs no padding: 32 rows). A
``weakref.finalize`` the loss attached to their storage ran when the CALLER dropped the batch,
after ``engine.compute`` had returned and every check was done, and wrote 1000 x one label's
count into the model's weights: the next step's gradients (and the trained model) carried it,
unnoised. Now every engine gives the forward and loss copies of its own
(``dpclip.engine.batch.owned_slice``), dropped inside the chunk's checks; what the finalizer does
there is refused or happens inside the step, never after it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import clip_weights

DT = torch.float64
_MODEL: list = []


def _poison(labels):
    if not _MODEL:  # (a finalizer of a finished test)
        return
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch.no_grad():
        _MODEL[0][1].weight.data[0, 0] += 1000.0 * sum(1 for v in labels if v == 2)


def _storage_of(t):
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        while torch._C._functorch.is_functorch_wrapped_tensor(t):  # (vmap's wrapper)
            t = torch._C._functorch.get_unwrapped(t)
        if isinstance(t, torch._subclasses.FakeTensor) or type(t) is not torch.Tensor:
            return None, None
        t = t._base if t._base is not None else t
        return t.untyped_storage(), t.reshape(-1).tolist()


def _marks_the_batch(out, y):
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    if _MODEL:
        storage, labels = _storage_of(y)
        if storage is not None:
            weakref.finalize(storage, _poison, labels)
        del storage
    return losses


@pytest.mark.parametrize("name, chunk", [
    ("ghost", None), ("auto", None), ("compiled", None), ("vmap", None), ("naive", None),
    ("ghost", 16), ("auto", 16), ("vmap", 16),  # (two chunks of 16: padded copies before too)
])
def test_the_model_never_sees_the_callers_batch(name, chunk):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 5, generator=g, dtype=DT)
    y = torch.randint(0, 3, (32,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 3)).to(DT)
    engine = get_engine(name, **({} if chunk is None else {"max_physical_batch": chunk}))
    _MODEL[:] = [model]
    try:
        for _ in range(2):  # (auto and compiled: a second step runs the proved program)
            try:
                engine.compute(model, _marks_the_batch, x, y, clip_weights(1.0),
                               ParamGroups.flat(model))
            except UnsupportedModelError:
                break  # (the write was seen inside the step: refused)
            gc.collect()
        after = model[1].weight.detach().clone()
        del x, y  # the caller drops its batch, after every check
        gc.collect()
        # (before: + 1000 x the count of label 2 here, under every engine but naive)
        assert torch.equal(model[1].weight.detach(), after)
    finally:
        _MODEL.clear()
