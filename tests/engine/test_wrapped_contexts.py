"""Forward passes that older Hugging Face releases write (transformers < 5.18, e.g. 5.17 on the GPU
machines): a ``torch.no_grad()`` / ``torch.autocast`` block inside the forward (the rotary
embedding), a branch on ``torch.compiler.is_compiling()`` (mask and position code), and a batched
matrix product of a constant expanded to the batch with example data
(``inv_freq[None, :, None].expand(B, -1, 1) @ position_ids[:, None, :]``). Each is proved
separable and runs on ghost equal to the float64 loop; beside each rule, the attacks it must
still refuse (the batch size used as a value inside the block, a product that contracts over the
batch, a constant whose rows depend on the position)."""

from __future__ import annotations

import pytest
import torch

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT, Head, assert_equal_to_the_loop, ce, clip_weights, loo_distance


def _data(b: int = 6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 4, generator=g, dtype=DT), torch.randint(0, 3, (b,), generator=g)


def _run(engine, model, x, y):
    return engine.compute(model, ce, x, y, clip_weights(0.5), ParamGroups.flat(model))


class NoGradBlock(Head):
    """A per-example scale computed without gradient, the batch size as a size inside the block
    (export: ``wrap_with_set_grad_enabled``, the symbol an operand of its subgraph)."""

    def forward(self, x):
        with torch.no_grad():
            scale = x.reshape(x.shape[0], 2, 2).abs().amax((1, 2))[:, None] + 1
        return self.fc(x / scale)


class AutocastBlock(Head):
    """A block under ``torch.autocast(enabled=False)`` (export: ``wrap_with_autocast``)."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            h = torch.tanh(x).view(x.shape[0], 2, 2).flatten(1) * 2
        return self.fc(h)


class CompileBranch(Head):
    """A library that builds its tensors another way when it believes it is compiled."""

    def forward(self, x):
        if torch.compiler.is_compiling():
            return self.fc(x * torch.ones_like(x))
        return self.fc(x)


class Rotary(Head):
    """transformers < 5.18's rotary embedding: the frequencies expanded to the batch, multiplied
    by each example's positions in a batched matrix product, under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv", torch.tensor([1.0, 0.5], dtype=DT))

    def forward(self, x):
        with torch.no_grad():
            f = self.inv[None, :, None].expand(x.shape[0], -1, 1) @ x[:, None, :2]
        return self.fc(x + torch.cos(f.flatten(1)))


SEPARABLE = {"no_grad": NoGradBlock, "autocast": AutocastBlock, "is_compiling": CompileBranch,
             "rotary": Rotary}


@pytest.mark.parametrize("name", list(SEPARABLE))
def test_runs_on_ghost_equal_to_the_loop(name):
    model = SEPARABLE[name]()
    x, y = _data()
    res = _run(GhostEngine(), model, x, y)
    assert_equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))
    res = _run(AutoEngine(), model, x, y)
    assert res.engine_info["engine"] == "ghost", res.engine_info


class SizeInsideNoGrad(Head):
    """Attack: the batch size used as a value inside the no_grad block."""

    def forward(self, x):
        with torch.no_grad():
            scale = torch.full_like(x[:, :1], x.shape[0])
        return self.fc(x * scale)


class MeanInsideNoGrad(Head):
    """Attack: the batch mean taken inside the no_grad block (mixes every example into every row)."""

    def forward(self, x):
        with torch.no_grad():
            m = x.mean(0, keepdim=True)
        return self.fc(x - 3 * m)


class ContractOverBatch(Head):
    """Attack: a constant ``(1, 4, B)`` times the data ``(1, B, 4)``: sums over the examples."""

    def forward(self, x):
        w = torch.ones(1, 4, x.shape[0], dtype=x.dtype)
        return self.fc(x + (w @ x[None])[0].sum(0, keepdim=True))


class PositionRows(Head):
    """Attack: a constant whose row ``i`` is ``i`` (``arange(B)``), in a batched product with the
    data: example ``i`` is scaled by its position."""

    def forward(self, x):
        c = torch.arange(x.shape[0], dtype=x.dtype)[:, None, None].expand(-1, 2, 1)
        return self.fc(x + (c @ x[:, None, :2]).flatten(1))


ATTACKS = {"size_inside_no_grad": SizeInsideNoGrad, "mean_inside_no_grad": MeanInsideNoGrad,
           "contract_over_batch": ContractOverBatch, "position_rows": PositionRows}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attacks_are_refused_by_ghost_and_auto_stays_sound(name):
    x, y = _data()
    with pytest.raises(UnsupportedModelError):
        _run(GhostEngine(), ATTACKS[name](), x, y)
    # auto: the vmap fallback (per example by construction) keeps one example's influence <= C
    assert loo_distance(AutoEngine, ATTACKS[name], x, y, 0.5) <= 1 + 1e-9
