"""Hundred-and-fortieth hostile review: every engine added each chunk's weighted sum to a float32
accumulator, which rounds each addition on the grid of the running total. Removing one example
shifts every later example one position, so every chunk's composition changes; inputs whose chunk
sums are exact, placed so that the full batch's additions all round up and the neighbour's all
round down, moved the release by far more than C with every weight exactly 1 (a plain
``Linear(1, 1)``): 5.48 C at B = 65,536 and ``max_physical_batch=32``, 1.54 C under vmap's
defaults, 9.69 C under ghost's at B = 2^20, through ``make_private`` too. Now the sums are
accumulated in float64 (float32 products exact there) and cast once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, get_engine

F32 = np.float32


def _design(b: int, m: int, hi: float = 0.99, fill: float = 0.75) -> np.ndarray:
    """Gradients ``x_i`` (|x_i| < 1 = C) against a float32 simulation of a chunked sum: chunk
    heads stepping down by 2 delta, one adjuster per chunk putting the full batch's running sum
    at residue q/2 + delta of the accumulator's grid q (the neighbour's at q/2 - delta)."""
    delta = max(2.0 ** (math.floor(math.log2(m * hi)) - 23), 2.0 ** -23)
    x = np.full(b, fill)
    h = round(hi / delta) * delta
    acc = F32(0.0)
    for start in range(0, b, m):
        x[start] = h
        rows = list(range(start, min(start + m, b)))
        if len(rows) >= 2:
            base = sum(x[i] for i in rows[:-1]) + 0.9
            q = float(np.spacing(F32(float(acc) + base)))
            x[rows[-1]] = 0.9 - ((base - q / 2 - delta) % q) if q >= 4 * delta else 0.9
            x[rows[-1]] = round(x[rows[-1]] / delta) * delta
        acc = F32(acc + F32(sum(x[i] for i in rows)))
        h = round((h - 2 * delta) / delta) * delta
    return x.astype(np.float32)


def _release(name, x, m):
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)
    res = get_engine(name, max_physical_batch=m).compute(
        model, lambda o, y: (o * y).sum(1), x, torch.ones_like(x),
        lambda n: torch.where(n > 0, torch.clamp(1.0 / n, max=1.0), torch.ones_like(n)),
        ParamGroups.flat(model))
    assert bool((res.weights == 1).all())  # (nothing clipped: every |x_i| < C)
    return res.grads["weight"].double().reshape(-1)


@pytest.mark.parametrize("name", ["vmap", "ghost"])
def test_the_others_chunk_sums_cannot_round_one_example_above_c(name):
    b, m = (4096, 2) if name == "vmap" else (2048, 8)
    x = torch.from_numpy(_design(b, m)).reshape(b, 1)
    loo = float((_release(name, x, m) - _release(name, x[1:], m)).norm())
    # |x_0| = 0.99 exactly; before: 1.31 C (vmap) / the float32 simulation's figure (ghost)
    assert loo <= 1.0, loo


# ---------------------------------------------------------------- review 141: inside one product

def _steered_chunk(head: float, n: int, climb: float = 0.98) -> list[float]:
    """``n`` values after ``head`` such that a SEQUENTIAL float32 sum of ``[head, *values]`` and
    of ``values`` alone (the neighbour without the head: every example one position earlier)
    drift apart: both climb to a power of two ``P``, the neighbour's just below (grid ``q``), the
    full sum at or above (grid ``2q``); then each value keeps the lower sum exact and makes the
    upper an exact tie rounding upwards (``q`` more per value)."""
    best = max((((n - math.ceil(2.0 ** e / climb) - 1) * 2.0 ** (e - 24), e)
                for e in range(1, 40) if math.ceil(2.0 ** e / climb) + 1 < n - 2))
    e = best[1]
    big, q = 2.0 ** e, 2.0 ** (e - 24)
    c = math.floor(climb / (2 * q)) * (2 * q)
    xs, low, high, a = [], 0.0, head, 2
    while big - a * q - low > c:
        xs.append(c)
        low, high = low + c, high + c
    xs.append(big - a * q - low)
    low, high = big - a * q, float(F32(high + xs[-1]))
    while len(xs) < n:
        for k in range(1, 9):
            v = (a - k) * q
            nl, nh = float(F32(low + v)), float(F32(high + v))
            if nl < big <= nh and nl == low + v and nh - nl > high - low:
                xs.append(v)
                low, high, a = nl, nh, k
                break
        else:
            xs.append(0.0)
    return xs


@pytest.mark.parametrize("name, positions", [("ghost", 0), ("auto", 0), ("ghost", 16)],
                         ids=["ghost", "auto", "ghost-kept-sequence"])
def test_the_others_rounding_inside_one_product_cannot_move_one_example_above_c(name, positions):
    """Hundred-and-forty-first hostile review: ghost's weighted sum over one chunk's examples
    was one float32 product (``torch.mm``), which MKL sums one example after another: one chunk
    of 4096 designed examples moved the release by 1.22 C (63.4 C at 65,536 in one chunk),
    through make_private too. The rules' products over the examples run in float64 now."""
    b, head = 4096, 0.97998046875
    x = np.zeros(b)
    x[0] = head
    x[1:] = _steered_chunk(head, b - 1)
    x = torch.from_numpy(x.astype(np.float32)).reshape(b, 1)
    if positions:  # (a sequence: the design at position 0, its per-example sums kept: _kept_sum)
        x = torch.cat([x[:, None], x.new_zeros(b, positions - 1, 1)], 1)
    assert float(x.abs().max()) < 0.99
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)

    def release(xs):
        res = get_engine(name).compute(
            model, lambda o, y: (o * y).flatten(1).sum(1), xs, torch.ones_like(xs),
            lambda n: torch.where(n > 0, torch.clamp(1.0 / n, max=1.0), torch.ones_like(n)),
            ParamGroups.flat(model))
        assert bool((res.weights == 1).all())
        return res.grads["weight"].double().reshape(-1)

    loo = float((release(x) - release(x[1:])).norm())
    assert loo <= 1.0, loo  # (|x_0| = 0.98; before: 1.2247 C)


# ---------------------------------------------------------------- review 146: the summed engine

def steered_lip_batch(b: int = 16384, head: float = 0.9765625):
    """Review 146's batch for a ``Linear(1, 2)`` under Lip-DP-SGD: example 0 at ``head``, the
    others a steered chunk (:func:`_steered_chunk`); labels 0."""
    x = np.zeros(b)
    x[0] = head
    x[1:] = _steered_chunk(head, b - 1)
    return (torch.from_numpy(x.astype(np.float32)).reshape(b, 1),
            torch.zeros(b, dtype=torch.long))


def test_a_bound_based_strategy_sums_the_batch_in_float64():
    """Hundred-and-forty-sixth hostile review: Lip-DP-SGD (``auto`` runs the summed engine) took
    one float32 backward of the batch, whose weight gradient MKL sums one example after another:
    the same designed batch moved its release by 2.45 times the certified sensitivity at
    B = 16,384 (31.7 at 65,536, 7646 at 2^20), through make_private. ``bound_step`` now runs the
    summed engine on float64 copies of the model (``SummedEngine.float64``)."""
    import dpclip

    x, y = steered_lip_batch()

    def released(xs, ys):
        model = nn.Linear(1, 2, bias=False)
        with torch.no_grad():
            model.weight.zero_()  # (the loss's logit gradient is exactly (-1/2, 1/2))
        n = float(xs.shape[0])
        dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.0), (xs, ys),
                                 noise_multiplier=1.0, steps=2, batch_size=n, engine="auto",
                                 strategy="lip-dp-sgd", strategy_params={"input_norm": 1.0},
                                 input_shape=(1,), reproducible_noise=True, seed=7, verbose=False)
        xb, yb = dp.sample()
        assert xb.shape[0] == xs.shape[0]
        dp.backward(xb, yb)
        delta = float(dp.strategy.sensitivity(dp.state))
        return model.weight.grad.double().reshape(-1) * n, delta

    full, delta = released(x, y)
    less, _ = released(x[1:], y[1:])
    # example 0's own gradient has norm 0.98 / sqrt(2) = 0.49 Delta; before: 2.45 Delta
    assert float((full - less).norm()) / delta <= 1.0
