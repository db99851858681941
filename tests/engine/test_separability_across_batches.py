"""The separability verdict across batch sizes, mutations, losses and dtypes (docs/engines.md,
"Separability without a trace").

Chains of known ``torch.nn`` modules are proved from the modules' semantics on every call (no
trace, no cache); everything else is traced on every call. These are the adversarial cases: a model
that mixes examples only above some batch size, a model changed after a step, a new loss function,
a dtype change. Each must be refused by ``ghost`` (and run on ``vmap`` under ``auto``) exactly when
it mixes, and otherwise equal the float64 per-example loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import dpclip.engine.separable as separable
from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, ParamGroups
from dpclip.engine.batch import padded_rows
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT, assert_close, assert_grads_close, clip_weights


def ce(o: Tensor, t: Tensor) -> Tensor:
    return nn.functional.cross_entropy(o, t, reduction="none")


def batch(b: int, d: int = 5, seed: int = 0, dtype=DT) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d, generator=g, dtype=dtype), torch.randint(0, 3, (b,), generator=g)


def run(engine, model, x, y, loss=ce):
    return engine.compute(model, loss, x, y, clip_weights(0.5), ParamGroups.flat(model))


def check_equals_oracle(res, model, x, y, loss=ce):
    ref = run(NaiveEngine(), model, x, y, loss)
    assert res.engine_info["engine"] == "ghost"
    assert_close(res.norms, ref.norms)
    assert_grads_close(res.grads, ref.grads)


class MixAbove(nn.Module):
    """Centres over the batch only when the batch has more than ``k`` examples."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(0) if x.shape[0] > self.k else x


class CustomMixAbove(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.k = nn.Linear(5, 6), nn.Linear(6, 3), k

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        if h.shape[0] > self.k:
            h = h * h.softmax(0)
        return self.fc2(h)


@pytest.mark.parametrize("build", [
    lambda: nn.Sequential(nn.Linear(5, 6), MixAbove(8), nn.Tanh(), nn.Linear(6, 3)),
    lambda: CustomMixAbove(8),
], ids=["chain-with-custom-module", "custom-forward"])
def test_a_model_that_mixes_only_above_a_batch_size_is_caught_there(build):
    """The branch ``if x.shape[0] > k`` reads the private batch size: refused at EVERY size (the
    proof with a symbolic batch size sees the condition; issue 31), on vmap under auto."""
    torch.manual_seed(0)
    model = build().to(DT)
    for b in (3, 8, 9, 30, 9, 4):
        x, y = batch(b, seed=b)
        with pytest.raises(UnsupportedModelError, match="not per-example separable|mixes|batch "
                                                        "size"):
            run(GhostEngine(), model, x, y)
        res = run(AutoEngine(), model, x, y)
        assert res.engine_info["engine"] == "vmap" and res.engine_info["fallback"]


def _mix_forward(x: Tensor) -> Tensor:
    return x - x.mean(0)


@pytest.mark.parametrize("mutate", [
    lambda m: m.__setitem__(1, nn.Softmax(dim=0)),  # a layer replaced
    lambda m: setattr(m[1], "dim", 0),  # a known layer's configuration changed
    lambda m: setattr(m[1], "forward", _mix_forward),  # an instance forward
    lambda m: m[1].register_forward_hook(lambda mod, i, o: o - o.mean(0)),  # a hook
    lambda m: setattr(m[1], "dim", -2),  # the batch dimension, counted from the end
], ids=["replaced", "config", "instance-forward", "hook", "config-negative"])
def test_a_model_mutated_after_a_step_is_caught(mutate):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.Softmax(dim=1), nn.Linear(5, 3)).to(DT)
    x, y = batch(6)
    check_equals_oracle(run(GhostEngine(), model, x, y), model, x, y)
    mutate(model)
    with pytest.raises((UnsupportedModelError, RuntimeError)):
        run(GhostEngine(), model, x, y)


def test_a_new_loss_function_is_traced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    x, y = batch(7)
    check_equals_oracle(run(GhostEngine(), model, x, y), model, x, y)

    def centred(o: Tensor, t: Tensor) -> Tensor:
        return ce(o - o.mean(0), t)

    with pytest.raises(UnsupportedModelError, match="losses are not per-example separable"):
        run(GhostEngine(), model, x, y, centred)
    check_equals_oracle(run(GhostEngine(), model, x, y), model, x, y)  # the old loss still runs


def test_a_dtype_change_gives_the_oracle_again():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 3))
    x32, y = batch(6, dtype=torch.float32)
    res = run(GhostEngine(), model, x32, y)
    assert res.grads["0.weight"].dtype == torch.float32
    model = model.to(DT)
    x, y = batch(6)
    check_equals_oracle(run(GhostEngine(), model, x, y), model, x, y)


def test_the_wrong_rank_for_a_known_layer_is_refused_not_assumed():
    """Conv1d reads a 2-D (C, L) tensor as ONE unbatched example: with the batch in dimension 0
    of a 2-D input (here the rows the engine runs = C = 32, so every shape fits) it mixes the examples. The rank check keeps such a chain
    off the untraced path, and the engine refuses a supported layer called below its batched
    rank (its rule would read the batch as channels)."""
    torch.manual_seed(0)
    rows = padded_rows(4)  # (the rows the engine runs: 4 examples padded to the row block)
    model = nn.Sequential(nn.Conv1d(rows, rows, 1), nn.Linear(5, 3)).to(DT)
    x, y = batch(4)
    with pytest.raises(UnsupportedModelError):
        run(GhostEngine(), model, x, y)


def _traced_ops(monkeypatch) -> list[str]:
    seen: list[str] = []
    orig = separable.SeparabilityTracer.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func._schema.name)
        return orig(self, func, types, args, kwargs)

    monkeypatch.setattr(separable.SeparabilityTracer, "__torch_dispatch__", spy)
    return seen


class _Twice(nn.Module):
    """A custom (separable) module: not a known ``torch.nn`` class, so the chain is traced."""

    def forward(self, x: Tensor) -> Tensor:
        return 2 * x


def test_known_chains_are_not_traced_at_new_batch_sizes_other_modules_are(monkeypatch):
    seen = _traced_ops(monkeypatch)
    torch.manual_seed(0)
    known = nn.Sequential(nn.Flatten(), nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    for b in (5, 6, 7):
        x, y = batch(b, seed=b)
        run(GhostEngine(), known, x, y)
    assert seen and not any("addmm" in s or "tanh" in s for s in seen)  # only the loss
    seen.clear()
    other = nn.Sequential(nn.Linear(5, 6), _Twice(), nn.Linear(6, 3)).to(DT)
    x, y = batch(5)
    run(GhostEngine(), other, x, y)
    assert any("addmm" in s for s in seen)
