"""``dpclip.training.release``: the one door where a noise std meets data (issue 34).

The source check below parses every module of ``src/dpclip`` and lists every place that names a
Gaussian draw (dpclip.noise's sampling functions, torch/NumPy normal samplers): only
``training/release.py`` may call dpclip.noise's draws, and every other draw is listed here with its
reason (public data, an estimator's start vector, symbolic operator tables). A new draw anywhere
fails this test until it is listed here and reviewed. What it cannot see: a draw reached through
``getattr`` with a computed name or through ``eval`` (not proven; none exist today).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from dpclip.clipping.fixed import FixedClip
from dpclip.clipping.quantile import QuantileClip
from dpclip.clipping.base import StepContext
from dpclip.events import ComposedEvent, GaussianEvent
from dpclip.training.release import Releaser, release
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler

SRC = Path(__file__).resolve().parents[2] / "src" / "dpclip"

#: dpclip.noise's functions that draw (only release.py may call them; ``_box_muller_cpu`` is
#: private to dpclip.noise: its CPU sampler behind ``standard_normal``)
NOISE_DRAWS = {"add_gaussian_noise", "add_gaussian_noise_all", "standard_normal", "_box_muller_cpu"}
#: Gaussian samplers of torch / NumPy (any base object: ``torch.randn``, ``t.randn``, ``rng.normal``),
#: and torch's uniform samplers (a hand-made Box-Muller turns uniforms into Gaussian noise)
RAW_DRAWS = {"randn", "randn_like", "normal", "normal_", "standard_normal", "multivariate_normal",
             "Normal", "MultivariateNormal", "rand", "rand_like", "uniform_"}

#: every module allowed to name a draw, and why (keep this short; review every addition)
ALLOWED: dict[str, set[str]] = {
    # the noise module itself: the float64 draw, its CPU Box-Muller (uniforms) and its helpers
    "noise.py": {"randn", "standard_normal", "add_gaussian_noise", "_box_muller_cpu", "uniform_"},
    # THE door: noise on the released sums and on the strategies' statistics
    # (and standard_normal: a distributed rank's block of the draw, training.noise_shard)
    "training/release.py": {"add_gaussian_noise", "add_gaussian_noise_all", "standard_normal"},
    # public data / public randomness, never added to a release:
    "audit/blackbox.py": {"standard_normal"},  # the auditor's synthetic data (NumPy)
    "bench.py": {"randn"},  # synthetic benchmark inputs
    "data/synthetic.py": {"randn"},  # the public synthetic dataset
    "federated/tracking.py": {"randn"},  # simulated norms of the quantile-tracking figure
    "lipschitz/norms.py": {"randn"},  # power iteration's start vector (weights are public)
    # operator tables of the separability proof (names of aten ops, nothing is drawn)
    "engine/batch_symbol.py": {"randn", "randn_like", "normal", "normal_", "rand", "rand_like",
                               "uniform_"},
    "engine/separable.py": {"normal_", "uniform_"},
}


def draws_in(source: str) -> set[str]:
    """The draw names a module's source mentions: attribute access (``x.randn``), bare names
    (``randn(...)`` after ``from torch import randn``) and imports (``from dpclip.noise import
    add_gaussian_noise as f``: the imported name, whatever the alias)."""
    names = NOISE_DRAWS | RAW_DRAWS
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.add(node.attr)
        elif isinstance(node, ast.Name) and node.id in names:
            found.add(node.id)
        elif isinstance(node, ast.ImportFrom):
            found.update(a.name for a in node.names if a.name in names)
    return found


def calls_noise_draws(source: str) -> bool:
    """Whether a module calls dpclip.noise's draws: imports one of them from ``dpclip.noise``,
    names ``add_gaussian_noise[_all]`` (unique to dpclip.noise), or imports the module
    ``dpclip.noise`` and reads ``.standard_normal`` from something (NumPy's generators share that
    name, so it counts only together with the import)."""
    tree = ast.parse(source)
    imports_module = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module == "dpclip.noise" and any(a.name in NOISE_DRAWS for a in node.names):
                return True
            if node.module == "dpclip" and any(a.name == "noise" for a in node.names):
                imports_module = True
        elif isinstance(node, ast.Import) and any(a.name == "dpclip.noise" for a in node.names):
            imports_module = True
    found = draws_in(source)
    return bool(found & (NOISE_DRAWS - {"standard_normal"})) or (
        imports_module and "standard_normal" in found)


def test_only_release_draws_noise_and_every_other_draw_is_listed() -> None:
    seen: dict[str, set[str]] = {}
    noise_callers: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        source = path.read_text()
        found = draws_in(source)
        if found:
            seen[rel] = found
        if rel != "noise.py" and calls_noise_draws(source):
            noise_callers.add(rel)
    assert noise_callers == {"training/release.py"}, (
        f"dpclip.noise's draws are called outside training/release.py: {sorted(noise_callers)}; "
        "route the release through dpclip.training.release.release (or its Releaser)")
    unlisted = {m: sorted(n - ALLOWED.get(m, set())) for m, n in seen.items()
                if n - ALLOWED.get(m, set())}
    assert not unlisted, f"new Gaussian draws outside the release door: {unlisted}"
    stale = {m for m in ALLOWED if m not in seen or not ALLOWED[m] <= seen[m]}
    assert not stale, f"allow-list entries that no longer draw (remove them): {sorted(stale)}"


@pytest.mark.parametrize("snippet", [
    "from dpclip.noise import add_gaussian_noise as f\nf(x, 1.0, g)",
    "import dpclip.noise as n\nn.add_gaussian_noise_all(x, 1.0, g)",
    "from dpclip import noise\nnoise.standard_normal(3, g, d, 'cpu')",
    "import torch as t\ny = x + t.randn(3, generator=g)",
    "from torch import randn\ny = randn(3)",
    "y = x.clone().normal_(0, 1)",
    "u = torch.empty(3).uniform_(generator=g)",
    "from dpclip.noise import _box_muller_cpu\n_box_muller_cpu(4, g)",
    "import numpy as np\nnp.random.default_rng().normal(size=3)",
    "from torch.distributions import Normal\nNormal(0, 1).sample()",
])
def test_the_source_check_sees_aliases_and_raw_draws(snippet: str) -> None:
    assert draws_in(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "from dpclip.noise import add_gaussian_noise as f\nf(x, 1.0, g)",
    "import dpclip.noise as n\nn.add_gaussian_noise_all(x, 1.0, g)",
    "from dpclip import noise\nnoise.standard_normal(3, g, d, 'cpu')",
    "import dpclip.noise\ndpclip.noise.standard_normal(3, g, d, 'cpu')",
    "from dpclip.noise import standard_normal\n",
    "import dpclip.noise as n\nn._box_muller_cpu(4, g)",
])
def test_the_source_check_sees_calls_of_dpclip_noise(snippet: str) -> None:
    assert calls_noise_draws(snippet), snippet
    assert not calls_noise_draws("import numpy as np\nnp.random.default_rng().standard_normal(3)")


def _ctx(m: float = 10.0) -> StepContext:
    return StepContext(step=0, epoch=0, steps_per_epoch=1, total_steps=1,
                       expected_batch_size=m, base_noise_multiplier=1.0)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_noise_std_is_z_times_sensitivity_on_the_sum_divided_once(per_tensor: bool) -> None:
    n = 200_000
    sums = {"a": torch.zeros(n, dtype=torch.float64), "b": torch.zeros(7, dtype=torch.float64)}
    g = torch.Generator().manual_seed(0)
    sampler = PoissonSampler(1000, 10.0)
    out = release(sums, noise_multiplier=1.5, sensitivity=2.0, divisor=10.0, generator=g,
                  strategy=FixedClip(clip_norm=2.0), state={}, norms=torch.empty(0),
                  ctx=_ctx(), sampler=sampler, sensitivity_factor=1, per_tensor=per_tensor)
    assert out.std == 3.0
    std = float(out.values["a"].std())
    assert std == pytest.approx(3.0 / 10.0, rel=0.01)  # z s / divisor (not divided twice)
    assert out.event == sampler.step_event(GaussianEvent(1.5))
    assert sums["a"].abs().max() == 0  # the input is not changed


def test_per_block_sensitivity_and_replace_one_factor() -> None:
    n = 100_000
    sums = {"a": torch.zeros(n, dtype=torch.float64), "b": torch.zeros(n, dtype=torch.float64)}
    g = torch.Generator().manual_seed(1)
    sampler = FixedSizeSampler(1000, 10)
    out = release(sums, noise_multiplier=1.0, sensitivity={"a": 1.0, "b": 4.0}, divisor=1.0,
                  generator=g, strategy=FixedClip(), state={}, norms=torch.empty(0),
                  ctx=_ctx(), sampler=sampler, sensitivity_factor=2)
    assert out.std == {"a": 1.0, "b": 4.0}
    assert float(out.values["a"].std()) == pytest.approx(1.0, rel=0.02)
    assert float(out.values["b"].std()) == pytest.approx(4.0, rel=0.02)


def test_the_strategy_releases_through_the_releaser_and_the_event_composes() -> None:
    strategy = QuantileClip(initial_clip_norm=1.0, count_noise_std=2.0)
    ctx = _ctx()
    state = strategy.begin_step(strategy.init_state(), ctx)
    z = strategy.noise_multiplier(state, 1.0)
    sampler = PoissonSampler(1000, 10.0)
    out = release({"w": torch.zeros(3)}, noise_multiplier=z, sensitivity=1.0, divisor=10.0,
                  generator=torch.Generator().manual_seed(0), strategy=strategy, state=state,
                  norms=torch.rand(10), ctx=ctx, sampler=sampler, sensitivity_factor=1)
    assert isinstance(out.event.event, ComposedEvent)  # type: ignore[union-attr]
    assert out.event == sampler.step_event(strategy.planned_event(1.0, ctx))
    assert out.state["clip_norm"] != 1.0  # the clip moved by the noisy count


def test_releaser_refuses_a_zero_sensitivity_and_scales_by_the_factor() -> None:
    r = Releaser(torch.Generator().manual_seed(0), 2)
    with pytest.raises(ValueError, match="sensitivity must be > 0"):
        r(torch.zeros(2), 0.0, 1.0)
    noisy, ev = r(torch.zeros(100_000, dtype=torch.float64), 1.5, 2.0)
    assert ev == GaussianEvent(2.0)
    assert float(noisy.std()) == pytest.approx(2.0 * 1.5 * 2, rel=0.02)


def test_bad_divisor_or_multiplier_is_refused() -> None:
    kw = dict(sensitivity=1.0, generator=torch.Generator(), strategy=FixedClip(), state={},
              norms=torch.empty(0), ctx=_ctx(), sampler=PoissonSampler(10, 2.0),
              sensitivity_factor=1)
    with pytest.raises(ValueError, match="divide_by"):
        release({"w": torch.zeros(2)}, noise_multiplier=1.0, divisor=math.nan, **kw)
    with pytest.raises(ValueError, match="noise_multiplier"):
        release({"w": torch.zeros(2)}, noise_multiplier=-1.0, divisor=1.0, **kw)


class _LoudCount(QuantileClip):
    """A mutant whose count is released with twice the planned multiplier."""

    def update(self, state, norms, ctx, release):  # type: ignore[override]
        new, (event,) = super().update(state, norms, ctx, release)
        return new, (GaussianEvent(2 * event.noise_multiplier),)


def test_a_step_emitting_another_event_than_planned_is_refused_and_not_recorded() -> None:
    from dpclip.training.plan import PlanMismatchError
    from dpclip.training.private import make_private

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    dp = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                      strategy=_LoudCount(initial_clip_norm=1.0, count_noise_std=1.0),
                      noise_multiplier=0.5, steps=2, batch_size=16, reproducible_noise=True,
                      verbose=False, engine="vmap")
    xb, yb = next(iter(dp.loader))
    with pytest.raises(PlanMismatchError, match="privacy bug.*step 0"):
        dp.step(xb, yb)
    assert dp.ledger.steps == 0
