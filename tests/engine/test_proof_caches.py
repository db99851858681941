"""The batch-size proof runs the user's forward on fake tensors; a memoising cache on one of the
model's methods stored what it computed there (transformers' ``compile_compatible_method_lru_cache``
on BEiT's relative position index: an ``lru_cache`` unless Dynamo is compiling). Kept, the fake was
handed to every later call: the real step was refused as a proof leftover (BEiT refused under
``auto``, "and the vmap fallback failed too"), and the user's own forward after the step returned
FakeTensor logits holding garbage. The proof now clears such caches after it
(``batch_symbol.caches_of_the_proof_cleared``).

Oracle: the float64 per-example loop (:func:`dpclip.engine.naive_per_example_grads`).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import (AutoEngine, GhostEngine, ParamGroups,
                           naive_per_example_grads)
from dpclip.engine.batch_symbol import _method_caches
from tests.engine.helpers import DT, assert_grads_close, ce, oracle_norms, oracle_sum


def _cached_method(func):
    """transformers' ``compile_compatible_method_lru_cache`` (its Dynamo branch left out): the
    cache lives in the wrapper's closure."""
    cached = functools.lru_cache(maxsize=8)(func)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return cached(*args, **kwargs)

    return wrapper


class _CachedIndex(nn.Module):
    """Reads its positions in a fixed order from an index its cached method builds from a public
    size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    @_cached_method
    def order(self, n: int) -> Tensor:
        return torch.arange(n).flip(0)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x[:, self.order(x.shape[1])]).mean(1)


class _CachedStatic(_CachedIndex):
    """The same with ``functools.cache`` on a static method (the cache is the class attribute)."""

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def order(n: int) -> Tensor:  # type: ignore[override]
        return torch.arange(n).flip(0)


def _wfn(n: Tensor) -> Tensor:
    return (0.3 / n).clamp(max=1.0)


def _clear(model: nn.Module) -> None:
    from dpclip.engine import batch_symbol

    batch_symbol._CACHE.clear()
    for c in _method_caches(model):
        c.cache_clear()


@pytest.mark.parametrize("build", [_CachedIndex, _CachedStatic])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_method_cache_filled_in_the_proof_is_not_kept(engine, build):
    """Before: the first step refused ("layer 'fc' was called on a tensor left over from the
    separability proof") and the model's own forward returned fakes after it. Now every step runs
    on ghost, equal to the loop (the caches the proof or a chunk filled are let go after it, so
    each real run computes the value as the proof did; batch sizes 5, 5, 3, 5), and the model's
    forward after the steps is real. The per-example loop between the steps fills the cache as a
    user's own evaluation would: the next step starts from an empty cache all the same (a step
    whose real run HIT a cache the kept proof had computed ran another program: refused)."""
    torch.manual_seed(0)
    model = build().to(DT)
    _clear(model)
    eng = engine()
    for b in (5, 5, 3, 5):
        x, y = torch.randn(b, 4, 6, dtype=DT), torch.randint(0, 3, (b,))
        groups = ParamGroups.flat(model)
        res = eng.compute(model, ce, x, y, _wfn, groups)
        assert res.engine_info["engine"] == "ghost"
        # nothing a private step computed is kept (the loop below fills the cache again, as the
        # user's own calls between steps do: the next step starts from an empty cache anyway)
        assert all(c.cache_info().currsize == 0 for c in _method_caches(model))
        per_ex = naive_per_example_grads(model, ce, x, y)
        torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, b), rtol=1e-9,
                                   atol=1e-12)
        assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, b))
    out = model(x)
    assert not is_fake(out) and not is_fake(model.order(4))
    torch.testing.assert_close(out, model.fc(x.flip(1)).mean(1))
    _clear(model)


_BOX: list = []


class _BatchSizeAcrossSteps(nn.Module):
    """Hostile reviews 63 and 64: a cache keyed by a public attribute (the epoch, set by the
    training loop) filled by a step with a tensor shaped by ITS batch size (a size use only), whose
    shape the steps that find it cached multiply their output by. Read by a later proof as a
    constant (63: the proof not kept once it filled the cache, re-proved; 64: a new proof for
    another loss), one example of the filling step moved a later step's release by 2.64 / 2.05 C.
    Refused at a150af6 (the proof's fake read by the real run)."""

    epoch = 0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    @functools.lru_cache(maxsize=1)
    def table(self, epoch: int) -> Tensor:
        x = _BOX[0]
        return x.new_zeros(x.shape[0], 1)

    def forward(self, x: Tensor) -> Tensor:
        before = self.table.cache_info().misses
        _BOX.append(x)
        t = self.table(self.epoch)
        _BOX.clear()
        if self.table.cache_info().misses != before:  # this call filled it
            return self.fc(x)
        return self.fc(x) * (t.shape[0] - 5.0) * 3.0  # a filling call's batch size


def _ce2(out: Tensor, y: Tensor) -> Tensor:  # another loss: a new proof
    return ce(out, y) * 1.0


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_batch_size_cached_by_a_private_step_never_reaches_a_later_one(engine):
    """Three steps (the epoch 0, 1, 1; the losses ce, ce, then another): removing one example of
    the second step leaves the third step's clipped sum exactly as it was, under ghost and auto
    (every step's real run computes the cached value itself)."""
    from dpclip.engine import batch_symbol

    torch.manual_seed(1)
    steps = [(torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))) for _ in range(3)]

    def third(second):
        batch_symbol._CACHE.clear()
        _BatchSizeAcrossSteps.table.cache_clear()
        torch.manual_seed(0)
        model = _BatchSizeAcrossSteps().to(DT)
        eng = engine()
        for i, (x, y) in enumerate([steps[0], second, steps[2]]):
            model.epoch = 0 if i == 0 else 1
            res = eng.compute(model, ce if i < 2 else _ce2, x, y, _wfn, ParamGroups.flat(model))
        return torch.cat([g.reshape(-1) for g in res.grads.values()])

    want = third(steps[1])
    for j in (0, 3):
        keep = [i for i in range(6) if i != j]
        got = third((steps[1][0][keep], steps[1][1][keep]))
        assert torch.equal(got, want)
    _BatchSizeAcrossSteps.table.cache_clear()


def test_the_caches_found_are_the_model_classes_own():
    """Found in the class dictionaries along the MROs (a closure cell, a static method), not in
    torch's own classes; reading them runs none of the model's code."""
    assert len(_method_caches(_CachedIndex())) == 1
    assert len(_method_caches(_CachedStatic())) == 2  # (its own and its base class's)
    assert _method_caches(nn.Sequential(nn.Linear(2, 2))) == []
    assert _method_caches(lambda x: x) == []  # (a plain callable: none)
    # a class naming itself torch's is still the model's (where it lives decides, not __module__)
    disguised = type("Linear", (_CachedIndex,), {"__module__": "torch.nn.modules.linear"})
    assert len(_method_caches(disguised())) == 1
