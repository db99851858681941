"""Each example's ghost norm (hence its weight) must not depend on the OTHER examples of the batch.

Regression: the book-keeping rounding term of a layer over positions, ``bk A_i``, was taken for a
reduction of length ``B T`` (the whole batch). Where an example's terms cancel (constant images into
a GroupNorm, constant sequences into a LayerNorm) that term IS its norm, so removing one example
from a batch of 6 changed every other example's Auto-V weight by ~17%, and the neighbouring clipped
sums differed by more than C (float32, tiny inputs: 1.0073 with C = 1). The book-keeping sums now
run over blocks of at most ``_BK_BLOCK`` examples (a public constant) and the bound is taken for
that length, whatever the batch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import dpclip.engine.ghost as ghost_mod
import dpclip.engine.ghost_rules as ghost_rules
from dpclip.clipping import make_strategy
from dpclip.engine import GhostEngine, ParamGroups
from dpclip.engine.ghost import NORM_MODES
from tests.engine.helpers import GROUPINGS, clip_weights
from tests.engine.test_ghost import _check, make
from tests.engine.test_ghost_rounding import ConvGN, EmbLN, SeqLN, ce

F32 = torch.float32


class Conv1dGN(nn.Module):
    """Conv1d (no padding) -> GroupNorm, one channel per group: the 1-D cancelling case."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3)
        self.gn = nn.GroupNorm(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.gn(self.conv(x)).flatten(1)


def _const(shape_one: tuple[int, ...], shape: tuple[int, ...], scale: float):
    def make_x(b: int, g: torch.Generator) -> Tensor:
        return (torch.randn(b, *shape_one, generator=g) * scale).expand(b, *shape).contiguous()
    return make_x


def _tiny_embedding() -> nn.Module:
    m = EmbLN()
    with torch.no_grad():
        m.emb.weight.mul_(1e-3)
    return m


# name: (model, inputs(b, g), classes, positions per example: the longest reduction behind a summed
# coordinate is a book-keeping sum over B x positions (generously: input positions))
CASES = {
    "conv2d_gn_1e-6": (ConvGN, _const((3, 1, 1), (3, 8, 8), 1e-6), 144, 64),
    "conv2d_gn_1e-3": (ConvGN, _const((3, 1, 1), (3, 8, 8), 1e-3), 144, 64),
    "conv2d_gn_1e5": (ConvGN, _const((3, 1, 1), (3, 8, 8), 1e5), 144, 64),
    "conv1d_gn_1e-3": (Conv1dGN, _const((3, 1), (3, 12), 1e-3), 40, 12),
    "seq_ln_1e-3": (SeqLN, _const((1, 4), (9, 4), 1e-3), 27, 9),
    "seq_ln_1e4": (SeqLN, _const((1, 4), (9, 4), 1e4), 27, 9),
    "embedding_tiny_one_token": (_tiny_embedding, lambda b, g: torch.full((b, 9), 2), 27, 9),
}
STRATEGIES = {
    "fixed": ("fixed", {"clip_norm": 0.1}),
    "auto-s": ("auto-s", {"clip_norm": 1.0}),
    "auto-v": ("auto-v", {"clip_norm": 1.0}),
    "psac": ("psac", {"clip_norm": 1.0}),
}


def _norm(grads: dict[str, Tensor]) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def _neighbours(case: str, mode: str, batch: int, seed: int) -> None:
    build, inputs, classes, red = CASES[case]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build().to(F32)
    x, y = inputs(batch, g), torch.randint(0, classes, (batch,), generator=g)
    groups = ParamGroups.flat(model)
    engine = GhostEngine(norm_mode=mode)
    for sname, (name, params) in STRATEGIES.items():
        strat = make_strategy(name, params)
        state = strat.init_state()
        c = strat.sensitivity(state)
        wf = lambda n, s=strat, st=state: s.weights(n, st)  # noqa: E731
        full = engine.compute(model, ce, x, y, wf, groups)
        assert torch.isfinite(full.weights).all()
        for i in range(batch):
            keep = [j for j in range(batch) if j != i]
            rest = engine.compute(model, ce, x[keep], y[keep], wf, groups)
            moved = _norm({n: full.grads[n].double() - rest.grads[n].double()
                           for n in full.grads})
            # C plus the float32 rounding of summing the others' vectors (each of norm <= C):
            # 2 gam(n) B C with n = B x the longest per-example reduction (docs/engines.md)
            slack = 2 * batch * red * 2.0 ** -24 * batch * c
            assert moved <= c + slack, (case, mode, sname, i, moved, c + slack)


@pytest.mark.parametrize("mode", NORM_MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_removing_one_example_moves_the_sum_by_at_most_c(case: str, mode: str) -> None:
    _neighbours(case, mode, 6, 0)


@pytest.mark.parametrize("mode", NORM_MODES)
@pytest.mark.parametrize("case,batch,seed", [("seq_ln_1e4", 6, 1), ("seq_ln_1e4", 9, 0),
                                             ("conv2d_gn_1e5", 9, 0), ("seq_ln_1e4", 3, 1)])
def test_other_batch_sizes_and_seeds(case: str, batch: int, seed: int, mode: str) -> None:
    """Variants the old bounds failed (fixed clipping, then PSAC, at huge scales)."""
    _neighbours(case, mode, batch, seed)


@pytest.mark.parametrize("mode", NORM_MODES)
def test_neighbours_with_several_book_keeping_blocks(mode: str, monkeypatch) -> None:
    """Blocks of 2 examples: removing one example regroups the others' blocks."""
    set_bk_block(monkeypatch, 2)
    for case in ("conv2d_gn_1e-3", "seq_ln_1e-3", "embedding_tiny_one_token"):
        _neighbours(case, mode, 7, 1)


@pytest.mark.parametrize("case", ["conv_variety", "seq_linear_layernorm", "embedding",
                                  "conv_groupnorm"])
def test_book_keeping_blocks_match_the_float64_oracle(case: str, monkeypatch) -> None:
    """Book-keeping over several blocks (``_BK_BLOCK`` = 2, 3 with a partial last block) equals the
    naive per-example loop in float64, for every norm mode and grouping."""
    model, x, y, loss_fn = make(case, 7, seed=3)
    for block in (2, 3):
        set_bk_block(monkeypatch, block)
        assert ghost_rules._bk_blocks(7) == [slice(i, min(i + block, 7)) for i in range(0, 7, block)]
        for grouping in GROUPINGS.values():
            groups = grouping(model)
            for mode in NORM_MODES:
                _check(GhostEngine(norm_mode=mode), model, x, y, loss_fn, groups,
                       clip_weights(0.2))


def set_bk_block(monkeypatch, block: int) -> None:
    """The book-keeping block size, in both modules that read it (the rules and the engine)."""
    monkeypatch.setattr(ghost_rules, "_BK_BLOCK", block)
    monkeypatch.setattr(ghost_mod, "_BK_BLOCK", block)
