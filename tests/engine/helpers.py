"""Float64 fixture models and independent oracles for the engine tests.

The oracles work from :func:`naive_per_example_grads` (one ordinary backward per example) with
explicit Python loops over examples and groups, so they share no reduction code with the engines.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor, nn

from dpclip.engine import ParamGroups, naive_per_example_grads

DT = torch.float64
N_CLASSES = 3


class Head(nn.Module):
    """Base of the review attacks' models: ``self.fc``, a float64 ``Linear(d, 3)`` drawn from seed
    0 (every instance the same, so a model rebuilt for the leave-one-out run is the same model)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(d, 3).to(DT)


class TwoLayers(nn.Module):
    """Base of the caught-error attacks' models: float64 ``fc1: Linear(5, 6)`` and
    ``fc2: Linear(6, 3)`` drawn from seed 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(5, 6).to(DT), nn.Linear(6, 3).to(DT)


def ce(out: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def sq_err(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).flatten(1).sum(1)


class SeqLinear(nn.Module):
    """Linear and LayerNorm on a 3-D (B, T, d) sequence, mean-pooled, then a classifier."""

    def __init__(self, d: int = 4, hidden: int = 5) -> None:
        super().__init__()
        self.proj = nn.Linear(d, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.norm(self.proj(x))).mean(1))


class EmbedNet(nn.Module):
    """Embedding of token ids (B, T) -> LayerNorm -> mean -> Linear."""

    def __init__(self, vocab: int = 11, d: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.emb(x)).mean(1))


class TiedNet(nn.Module):
    """Embedding whose weight is reused by the output layer (tied weights, anchors P17)."""

    def __init__(self, vocab: int = 7, d: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mix(self.emb(x).mean(1))))


class ConvNet(nn.Module):
    """Conv2d with stride/padding/groups/dilation variety, GroupNorm, and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(2, 4, 3, stride=2, padding=1),
            nn.GroupNorm(2, 4),
            nn.Tanh(),
            nn.Conv2d(4, 6, 2, stride=1, padding=0, groups=2, dilation=1),
            nn.Tanh(),
            nn.Conv2d(6, 4, 3, stride=1, padding=2, dilation=2, bias=False),
        )
        self.head = nn.Linear(4 * 4 * 4, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.features(x)).flatten(1))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, N_CLASSES))


def frozen_mlp() -> nn.Module:
    m = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, N_CLASSES))
    m[2].weight.requires_grad_(False)
    return m


@dataclass(frozen=True)
class Case:
    """A model builder, an input builder and the per-example loss."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], Tensor]
    targets: Callable[[int, torch.Generator], Tensor]
    loss_fn: Callable[[Tensor, Tensor], Tensor] = ce

    def make(self, batch: int, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
        torch.manual_seed(seed)
        model = self.build().to(DT)
        gen = torch.Generator().manual_seed(seed + 1)
        return model, self.inputs(batch, gen), self.targets(batch, gen)


def _randn(*shape: int) -> Callable[[int, torch.Generator], Tensor]:
    return lambda b, g: torch.randn(b, *shape, generator=g, dtype=DT)


def _labels(b: int, g: torch.Generator) -> Tensor:
    return torch.randint(0, N_CLASSES, (b,), generator=g)


CASES = {
    c.name: c
    for c in [
        Case("linear", mlp, _randn(5), _labels),
        Case("linear_mse", mlp, _randn(5), _randn(N_CLASSES), sq_err),
        Case("seq_linear_layernorm", SeqLinear, _randn(6, 4), _labels),
        Case("conv_groupnorm", ConvNet, _randn(2, 9, 9), _labels),
        Case("embedding", EmbedNet, lambda b, g: torch.randint(0, 11, (b, 5), generator=g), _labels),
        Case("tied", TiedNet, lambda b, g: torch.randint(0, 7, (b, 3), generator=g),
             lambda b, g: torch.randint(0, 7, (b,), generator=g)),
        Case("frozen", frozen_mlp, _randn(5), _labels),
    ]
}


def custom_groups(model: nn.Module) -> ParamGroups:
    """Two groups: all weights (>= 2-D params) and everything else."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    big = tuple(n for n in names if dict(model.named_parameters())[n].ndim >= 2)
    small = tuple(n for n in names if n not in big)
    if not small:
        return ParamGroups(("first", "rest"), ((names[0],), tuple(names[1:])))
    return ParamGroups(("weights", "others"), (big, small))


GROUPINGS: dict[str, Callable[[nn.Module], ParamGroups]] = {
    "flat": ParamGroups.flat,
    "per_layer": ParamGroups.per_layer,
    "per_parameter": ParamGroups.per_parameter,
    "custom": custom_groups,
}


def clip_weights(c: float | Tensor) -> Callable[[Tensor], Tensor]:
    """Abadi: ``min(1, C/n)`` (``+inf`` -> 0, ``0`` -> 1)."""
    return lambda n: torch.where(n > 0, torch.clamp(c / n, max=1.0), torch.ones_like(n))


def auto_s_weights(c: float | Tensor, gamma: float = 0.01) -> Callable[[Tensor], Tensor]:
    """Auto-S: ``C/(n + gamma)``."""
    return lambda n: c / (n + gamma)


def oracle_norms(per_ex: dict[str, Tensor], groups: ParamGroups, batch: int) -> Tensor:
    """Explicit loop: norm of example i in group g; ``+inf`` everywhere for a non-finite example."""
    rows = []
    for i in range(batch):
        finite = all(bool(torch.isfinite(per_ex[n][i]).all()) for n in per_ex)
        row = []
        for members in groups.members:
            s = sum(float((per_ex[n][i] ** 2).sum()) for n in members)
            row.append(math.sqrt(s) if finite else math.inf)
        rows.append(row)
    out = torch.tensor(rows, dtype=DT).reshape(batch, len(groups))
    return out[:, 0] if groups.is_flat else out


def oracle_sum(
    per_ex: dict[str, Tensor], weights: Tensor, groups: ParamGroups, batch: int
) -> dict[str, Tensor]:
    """Explicit loop ``sum_i w_{i, group(p)} g_{i, p}`` skipping non-finite examples."""
    w = weights.reshape(batch, len(groups))
    group_of = {n: g for g, mem in enumerate(groups.members) for n in mem}
    out = {n: torch.zeros(t.shape[1:], dtype=t.dtype) for n, t in per_ex.items()}
    for i in range(batch):
        if not all(bool(torch.isfinite(per_ex[n][i]).all()) for n in per_ex):
            continue
        for n in per_ex:
            out[n] = out[n] + w[i, group_of[n]] * per_ex[n][i]
    return out


def assert_close(actual: Tensor, expected: Tensor, rtol: float = 1e-10) -> None:
    """Relative agreement to ``rtol`` (absolute floor scaled by the expected magnitude)."""
    scale = float(expected[torch.isfinite(expected)].abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-3) * 1e-2)


def assert_grads_close(actual: dict[str, Tensor], expected: dict[str, Tensor], rtol: float = 1e-10) -> None:
    assert set(actual) == set(expected)
    for n in expected:
        assert actual[n].shape == expected[n].shape, n
        assert actual[n].dtype == expected[n].dtype, n
        assert_close(actual[n], expected[n], rtol)


def is_real(t: Tensor) -> bool:
    """A plain tensor with data (not a subclass, not a ``FakeTensor``): the review attacks'
    finalizers act only on those, not on the engine's shape-only traces."""
    return type(t) is torch.Tensor and not isinstance(t, torch._subclasses.FakeTensor)


class Scale(nn.Module):
    """``h * a`` with a 4-vector parameter ``a`` (ones): a module without a ghost rule, so it takes
    the per-layer path."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(4, dtype=DT))

    def forward(self, h: Tensor) -> Tensor:
        return h * self.a


def outlier_batch() -> tuple[Tensor, Tensor]:
    """Eight float64 examples of 5 features (generator seed 0), labels in ``0..2``; example 0 is
    scaled by 50 (an outlier, which the review attacks' finalizers detect by ``|x| > 20``)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, generator=g, dtype=DT), torch.randint(0, N_CLASSES, (8,), generator=g)
    x[0] *= 50
    return x, y


def loo_distance(
    engine: Callable[[], object],
    make: Callable[[], nn.Module],
    x: Tensor,
    y: Tensor,
    c: float,
    loss: Callable[[Tensor, Tensor], Tensor] = ce,
    exact: bool = False,
) -> float:
    """Leave-one-out distance of the released clipped sum, in units of ``c``.

    ``max_j ||S(X) - S(X without j)|| / c``, where ``S`` is ``engine().compute`` on a fresh
    ``make()`` with Abadi clipping at ``c`` (:func:`clip_weights`) and flat groups, its gradients
    concatenated (``exact``: in float64, so that the differences of float32 sums are not rounded
    themselves). Sound: ``<= 1``. An :class:`~dpclip.engine.UnsupportedModelError` propagates.
    """

    def release(xs: Tensor, ys: Tensor) -> Tensor:
        model = make()
        res = engine().compute(model, loss, xs, ys, clip_weights(c), ParamGroups.flat(model))
        return torch.cat([(g.double() if exact else g).reshape(-1) for g in res.grads.values()])

    def norm(d: Tensor) -> float:  # (exact: scaled, so that tiny differences do not underflow)
        if not exact:
            return float(d.norm())
        top = float(d.abs().max()) if d.numel() else 0.0
        return top * float((d / top).norm()) if top > 0 else 0.0

    full = release(x, y)
    n = x.shape[0]
    return max(norm(full - release(x[keep], y[keep])) / c
               for keep in ([i for i in range(n) if i != j] for j in range(n)))


def assert_matches_the_loop(
    res, per_ex: dict[str, Tensor], groups: ParamGroups, batch: int
) -> None:
    """An engine result against the float64 per-example loop ``per_ex``: the norms equal
    :func:`oracle_norms` (rtol 1e-10, atol 1e-12), the sum equals :func:`oracle_sum` with the
    result's own weights (:func:`assert_grads_close`)."""
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, batch), rtol=1e-10,
                               atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, batch))


def assert_equal_to_the_loop(
    res,
    model: nn.Module,
    loss: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    groups: ParamGroups,
    engine: str | None = "ghost",
) -> None:
    """``res`` (an engine's result on ``x, y``) equals the float64 loop on ``model``.

    ``res.engine_info["engine"]`` must be ``engine`` (not checked when ``engine`` is ``None``);
    then :func:`naive_per_example_grads` of ``model`` (the model the engine ran, or a fresh copy
    of it) under ``loss`` is compared by :func:`assert_matches_the_loop`.
    """
    if engine is not None:
        assert res.engine_info.get("engine") == engine, res.engine_info
    per_ex = naive_per_example_grads(model, loss, x, y)
    assert_matches_the_loop(res, per_ex, groups, x.shape[0])


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as a module (the rounding tests reuse its models)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: the engines a traced-path attack is run under: ghost, auto with its compiled path off, and
#: auto with a profile function set (which sends it to its traced pass)
TRACED_ENGINES = ("auto-profiled", "auto-traced", "ghost")


def _quiet_profile(frame, event, arg):  # (a profile function that does nothing)
    return None


def assert_refused_or_bounded(engine: str, make: Callable[[], nn.Module], x: Tensor, y: Tensor,
                              c: float, loss: Callable[[Tensor, Tensor], Tensor],
                              refusal: tuple[str, ...]) -> None:
    """Under ``engine`` (``"ghost"``, ``"auto"``, ``"auto-traced"``: ``AutoEngine(compiled=False)``,
    or ``"auto-profiled"``: auto with a profile function set), the model from ``make`` is either
    refused with a message containing one of ``refusal``, or its release moves by at most ``c``
    when one example leaves."""
    import sys

    from dpclip.engine import AutoEngine, get_engine
    from dpclip.engine.errors import UnsupportedModelError

    factory = (lambda: AutoEngine(compiled=False)) if engine == "auto-traced" else \
        (lambda: get_engine("auto" if engine == "auto-profiled" else engine))
    was = sys.getprofile()
    if engine == "auto-profiled":
        sys.setprofile(_quiet_profile)
    try:
        d = loo_distance(factory, make, x, y, c, loss=loss)
    except UnsupportedModelError as e:
        assert any(r in str(e) for r in refusal), e
        return
    finally:
        sys.setprofile(was)
    assert d <= 1 + 1e-6, (engine, d)
