"""The ghost engine's separability guarantee (issue 15, item 3): a model whose batched forward
mixes examples, or hands a layer the batch in another dimension, is refused by ``ghost`` and runs on
``vmap`` under ``auto`` (recorded in ``engine_info``), with the ``vmap`` result; separable models
stay on the ghost path. The check is :mod:`dpclip.engine.separable` (an op-by-op trace)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError, VmapEngine
from dpclip.engine.separable import MIXED, SeparabilityTracer
from tests.engine.helpers import DT, assert_close, assert_grads_close, ce, clip_weights

B = 6


class Centred(nn.Module):
    """Centres the batch before the first layer: ``x - x.mean(0)`` (no parameter involved)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x - x.mean(0))))


class SeqFirst(nn.Module):
    """Takes (B, T, d), transposes to the sequence-first (T, B, d) layout and applies a Linear
    there; with T == B every shape check passes."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.proj(x.transpose(0, 1)))  # (T, B, d): the batch in dimension 1
        return self.head(h.mean(0))  # mean over T: (B, d)


class Mixer(nn.Module):
    """A parameter-free mixing layer between two Linear layers."""

    def __init__(self, mix) -> None:
        super().__init__()
        self.fc1, self.fc2, self.mix = nn.Linear(5, 7), nn.Linear(7, 3), mix

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.mix(torch.tanh(self.fc1(x))))


class AddMean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + x.mean(0)


class SoftmaxBatch(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.softmax(x, dim=0)


class RollBatch(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.roll(x, 1, dims=0)


class FlipPositions(nn.Module):
    """A data-independent layer output (position embedding) flipped over the batch: each row of
    the output reaches another example's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.head = nn.Embedding(4, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        pos = torch.arange(x.shape[1]).expand(x.shape[0], -1).contiguous()
        return self.head((self.pos(pos).flip(0) * x[..., None]).mean(1))


def _seq_case(t: int) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    return SeqFirst().to(DT), torch.randn(B, t, 4, dtype=DT), torch.randint(0, 3, (B,))


def _mixer_case(mix: nn.Module) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    return Mixer(mix).to(DT), torch.randn(B, 5, dtype=DT), torch.randint(0, 3, (B,))


MIXING = {
    "centred": lambda: (Centred().to(DT), torch.randn(B, 5, dtype=DT), torch.randint(0, 3, (B,))),
    "add_batch_mean": lambda: _mixer_case(AddMean()),
    "softmax_over_batch": lambda: _mixer_case(SoftmaxBatch()),
    "roll_over_batch": lambda: _mixer_case(RollBatch()),
    "flipped_position_embedding": lambda: (FlipPositions().to(DT), torch.randn(B, 4, dtype=DT),
                                           torch.randint(0, 3, (B,))),
}


@pytest.mark.parametrize("case", sorted(MIXING))
def test_mixing_models_refused_by_ghost_and_fall_back_under_auto(case: str) -> None:
    torch.manual_seed(0)
    model, x, y = MIXING[case]()
    groups = ParamGroups.flat(model)
    wf = clip_weights(0.05)
    with pytest.raises(UnsupportedModelError, match="separable|mixes|dimension 1"):
        GhostEngine().compute(model, ce, x, y, wf, groups)
    auto = AutoEngine().compute(model, ce, x, y, wf, groups)
    assert auto.engine_info["engine"] == "vmap" and auto.engine_info["requested"] == "auto"
    assert auto.engine_info["fallback"]
    ref = VmapEngine().compute(model, ce, x, y, wf, groups)
    assert_close(auto.norms, ref.norms)
    assert_grads_close(auto.grads, ref.grads)
    # and ghost with fallback='vmap' records the same
    fb = GhostEngine(fallback="vmap").compute(model, ce, x, y, wf, groups)
    assert fb.engine_info["engine"] == "vmap" and fb.engine_info["fallback"]


def test_centring_moves_other_examples_under_ghost_before_the_fix() -> None:
    """What the check prevents: under the batched forward, one example moves the clipped sum by
    more than C (vmap, the reference, is within C)."""
    model, x, y = MIXING["centred"]()
    groups, c = ParamGroups.flat(model), 0.05
    eng = AutoEngine()

    def total(xs: Tensor, ys: Tensor) -> dict[str, Tensor]:
        return eng.compute(model, ce, xs, ys, clip_weights(c), groups).grads

    full, without = total(x, y), total(x[1:], y[1:])
    moved = sum(float(((full[n] - without[n]) ** 2).sum()) for n in full) ** 0.5
    assert moved <= c * (1 + 1e-9)


@pytest.mark.parametrize("t", [3, B, B + 1])
def test_sequence_first_runs_on_ghost_alike_at_every_length(t: int) -> None:
    """A Linear on the sequence-first (T, B, d) layout reads example i from column i (the trace's
    layout, never the sizes: T == B reads the same; tests/engine/test_ghost_sequence_first.py).
    It was refused at every length before the ninth session."""
    model, x, y = _seq_case(t)
    groups = ParamGroups.flat(model)
    res = GhostEngine().compute(model, ce, x, y, clip_weights(1.0), groups)
    assert res.engine_info["engine"] == "ghost"
    ref = VmapEngine().compute(model, ce, x, y, clip_weights(1.0), groups)
    assert_close(res.norms, ref.norms)
    assert_grads_close(res.grads, ref.grads)


def test_a_mixing_model_is_refused_at_a_batch_of_one() -> None:
    """A batch of one runs as a batch of two (the example and its copy, weighted 0), proved as any
    batch: the verdict on a mixing model does not depend on the realised batch size (it ran on
    ghost at one example before)."""
    model, x, y = MIXING["centred"]()
    with pytest.raises(UnsupportedModelError, match="mixes the examples"):
        GhostEngine().compute(model, ce, x[:1], y[:1], clip_weights(1.0), ParamGroups.flat(model))


def test_chunks_of_one_of_a_mixing_model() -> None:
    """``max_physical_batch=1``: ghost refuses a model that mixes the batch as at any chunk size
    (it ran before, with the vmap semantics of one example alone); ``auto`` runs it on vmap,
    recorded, equal to the vmap engine."""
    model, x, y = MIXING["roll_over_batch"]()
    groups, wf = ParamGroups.flat(model), clip_weights(0.5)
    with pytest.raises(UnsupportedModelError, match="mixes the examples"):
        GhostEngine(max_physical_batch=1).compute(model, ce, x, y, wf, groups)
    res = AutoEngine(max_physical_batch=1).compute(model, ce, x, y, wf, groups)
    ref = VmapEngine().compute(model, ce, x, y, wf, groups)
    assert res.engine_info["engine"] == "vmap"
    assert_grads_close(res.grads, ref.grads)


class Separable(nn.Module):
    """Batch-first model with per-example ops of many kinds: softmax/mean over non-batch dims,
    reshape/transposes that keep the batch first, padding, pooling, dropout (eval), cat with a
    constant token, in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular")
        self.gn = nn.GroupNorm(1, 3)
        self.proj = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)
        self.register_buffer("tok", torch.zeros(1, 1, 4))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu_(self.gn(self.conv(x)))  # (B, 3, 4, 4)
        h = nn.functional.max_pool2d(h, 2).flatten(2).transpose(1, 2)  # (B, 4, 3)
        h = nn.functional.pad(h, (0, 1))  # (B, 4, 4)
        h = torch.cat([self.tok.expand(h.shape[0], -1, -1), h], dim=1)  # (B, 5, 4)
        h = self.ln(self.proj(h))
        h = h * torch.softmax(h, dim=1)
        return self.head(h.reshape(h.shape[0], 5, 2, 2).sum((2,)).mean(1).repeat(1, 2))


def test_separable_model_stays_on_ghost_and_matches_vmap() -> None:
    torch.manual_seed(0)
    model = Separable().to(DT).eval()
    x, y = torch.randn(B, 2, 4, 4, dtype=DT), torch.randint(0, 3, (B,))
    groups, wf = ParamGroups.flat(model), clip_weights(0.3)
    res = GhostEngine().compute(model, ce, x, y, wf, groups)
    ref = VmapEngine().compute(model, ce, x, y, wf, groups)
    assert res.engine_info["engine"] == "ghost"
    assert_close(res.norms, ref.norms)
    assert_grads_close(res.grads, ref.grads)


def test_loss_normalised_over_the_batch_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(B, 5, dtype=DT), torch.randint(0, 3, (B,))

    def loss(out: Tensor, t: Tensor) -> Tensor:
        per = ce(out, t)
        return per / per.sum()

    with pytest.raises(UnsupportedModelError, match="losses"):
        GhostEngine().compute(model, loss, x, y, clip_weights(1.0), ParamGroups.flat(model))


def test_python_value_from_batch_data_is_a_violation() -> None:
    torch.manual_seed(0)

    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x: Tensor) -> Tensor:
            scale = float(x.abs().max())  # one number from the whole batch
            return self.fc(x / scale)

    model = Branch().to(DT)
    x, y = torch.randn(B, 5, dtype=DT), torch.randint(0, 3, (B,))
    with pytest.raises(UnsupportedModelError, match="Python"):
        GhostEngine().compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))


def test_custom_autograd_function_is_refused() -> None:
    class CentreGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return g - g.mean(0)  # mixes the examples' gradients

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(5, 4), nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc2(CentreGrad.apply(self.fc1(x)))

    torch.manual_seed(0)
    model = M().to(DT)
    x, y = torch.randn(B, 5, dtype=DT), torch.randint(0, 3, (B,))
    with pytest.raises(UnsupportedModelError, match="autograd.Function"):
        GhostEngine().compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))


def test_tracer_inplace_write_into_a_view_taints_other_views() -> None:
    x = torch.randn(B, 3)
    with SeparabilityTracer(B) as tr:
        tr.mark(x, (0, 1))
        buf = torch.zeros(B, 3)
        view = buf[:, :2]
        row0 = buf[0]
        view.copy_(x[:, :2].flip(0))  # data from other examples written into buf
        s = row0.sum()
    assert tr.layout(view) is MIXED
    assert tr.layout(buf) is MIXED and tr.layout(s) is MIXED
