"""Tuple and dict model inputs (and targets) on every engine, against a float64 per-example loop.

The oracle indexes every leaf by hand and calls the model as the user would (``model(x1, x2)``,
``model(**inputs)``) on one example at a time, with an ordinary backward: it shares no code with
the engines' batch handling (``dpclip.engine.batch``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, ParamGroups, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT, assert_close, assert_grads_close, clip_weights

VOCAB, T, PAD = 13, 6, 0


class Tagger(nn.Module):
    """A token tagger called as ``model(input_ids=..., attention_mask=...)``: embedding, a
    sequence Linear, LayerNorm, and a per-token output layer; padded positions are zeroed."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 5, padding_idx=PAD)
        self.proj = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.out = nn.Linear(7, 4)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = torch.tanh(self.norm(self.proj(self.emb(input_ids))))
        return self.out(h * attention_mask.unsqueeze(-1).to(h.dtype))


def token_loss(out: Tensor, targets: dict) -> Tensor:
    """Cross-entropy per token, averaged per example over its non-pad tokens (shape (B,))."""
    labels, mask = targets["labels"], targets["mask"].to(out.dtype)
    per_tok = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1),
                                          reduction="none").reshape(labels.shape)
    return (per_tok * mask).sum(1) / mask.sum(1).clamp(min=1.0)


class PooledClassifier(nn.Module):
    """``model(ids, mask)`` (a tuple): masked mean pooling of embeddings, then a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        m = mask.to(torch.float64).unsqueeze(-1)
        pooled = (self.emb(ids) * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.head(pooled)


class TwoTower(nn.Module):
    """``model(x_img, x_tab)``: a Conv1d tower and a Linear tower, summed; a regression output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)
        self.tab = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x_seq: Tensor, x_tab: Tensor) -> Tensor:
        return self.head(torch.tanh(self.conv(x_seq).mean(-1) + self.tab(x_tab)))


def mse(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).sum(1)


def _tokens(b: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    ids = torch.randint(1, VOCAB, (b, T), generator=g)
    lengths = torch.randint(1, T + 1, (b, 1), generator=g)
    mask = torch.arange(T)[None, :] < lengths
    return ids.masked_fill(~mask, PAD), mask


def make_case(name: str, b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "dict-tagger":
        model = Tagger().to(DT)
        ids, mask = _tokens(b, g)
        labels = torch.randint(0, 4, (b, T), generator=g)
        return model, {"input_ids": ids, "attention_mask": mask}, \
            {"labels": labels, "mask": mask}, token_loss
    if name == "tuple-pooled":
        model = PooledClassifier().to(DT)
        ids, mask = _tokens(b, g)
        return model, (ids, mask), torch.randint(0, 3, (b,), generator=g), \
            lambda o, y: nn.functional.cross_entropy(o, y, reduction="none")
    if name == "tuple-two-tower":
        model = TwoTower().to(DT)
        xs = (torch.randn(b, 2, 5, generator=g, dtype=DT), torch.randn(b, 4, generator=g, dtype=DT))
        return model, xs, torch.randn(b, 2, generator=g, dtype=DT), mse
    raise KeyError(name)


CASES = ["dict-tagger", "tuple-pooled", "tuple-two-tower"]


def call(model, x):
    return model(**x) if isinstance(x, dict) else model(*x)


def pick(tree, i):
    if isinstance(tree, dict):
        return {k: v[i:i + 1] for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(v[i:i + 1] for v in tree)
    return tree[i:i + 1]


def oracle(model, x, y, loss_fn, b):
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    per_ex = {n: [] for n in params}
    losses = []
    for i in range(b):
        loss = loss_fn(call(model, pick(x, i)), pick(y, i))
        assert loss.shape == (1,)
        losses.append(float(loss.detach()))
        gs = torch.autograd.grad(loss.sum(), list(params.values()), allow_unused=True)
        for n, gr in zip(params, gs):
            per_ex[n].append(torch.zeros_like(params[n]) if gr is None else gr)
    return {n: torch.stack(v) for n, v in per_ex.items()}, losses


ENGINES = {
    "naive": lambda: NaiveEngine(max_physical_batch=3),
    "vmap": lambda: VmapEngine(max_physical_batch=3),
    "ghost": lambda: GhostEngine(),
    "ghost-chunked": lambda: GhostEngine(max_physical_batch=3),
    "auto": lambda: AutoEngine(),
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("grouping", ["flat", "layer"])
@pytest.mark.parametrize("case", CASES)
def test_structured_inputs_match_per_example_loop(case, grouping, engine):
    b = 7
    model, x, y, loss_fn = make_case(case, b)
    groups = ParamGroups.flat(model) if grouping == "flat" else ParamGroups.per_layer(model)
    per_ex, losses = oracle(model, x, y, loss_fn, b)
    res = ENGINES[engine]().compute(model, loss_fn, x, y, clip_weights(0.3), groups)
    if engine in ("ghost", "ghost-chunked", "auto"):
        assert res.engine_info["engine"] == "ghost", res.engine_info  # proved separable
    rows = []
    for i in range(b):
        row = [math.sqrt(sum(float((per_ex[n][i] ** 2).sum()) for n in mem))
               for mem in groups.members]
        rows.append(row)
    expected_norms = torch.tensor(rows, dtype=DT)
    expected_norms = expected_norms[:, 0] if groups.is_flat else expected_norms
    assert_close(res.norms, expected_norms)
    w = clip_weights(0.3)(expected_norms).reshape(b, len(groups))
    group_of = {n: gi for gi, mem in enumerate(groups.members) for n in mem}
    expected = {n: sum(w[i, group_of[n]] * per_ex[n][i] for i in range(b)) for n in per_ex}
    assert_grads_close(res.grads, expected)
    assert res.loss_sum == pytest.approx(sum(losses), rel=1e-12)


def test_padding_changes_nothing_beyond_the_mask():
    """The masked token loss ignores what sits at padded positions: changing those labels and ids
    leaves the engines' result unchanged (a property of the loss the oracle above also checks)."""
    model, x, y, loss_fn = make_case("dict-tagger", 5)
    res = GhostEngine().compute(model, loss_fn, x, y, clip_weights(1.0), ParamGroups.flat(model))
    pad = ~x["attention_mask"]
    x2 = {"input_ids": x["input_ids"].masked_fill(pad, 3), "attention_mask": x["attention_mask"]}
    y2 = {"labels": y["labels"].masked_fill(pad, 2), "mask": y["mask"]}
    res2 = GhostEngine().compute(model, loss_fn, x2, y2, clip_weights(1.0),
                                 ParamGroups.flat(model))
    assert_close(res2.norms, res.norms, rtol=1e-12)


class MixesThroughSecondInput(nn.Module):
    """Separable in ``x`` but centres the second input over the batch: must be refused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        return self.fc(x + (z - z.mean(0)))


def test_mixing_through_a_dict_or_tuple_leaf_is_caught():
    g = torch.Generator().manual_seed(1)
    model = MixesThroughSecondInput().to(DT)
    x, z = torch.randn(6, 4, generator=g, dtype=DT), torch.randn(6, 4, generator=g, dtype=DT)
    y = torch.randint(0, 2, (6,), generator=g)

    def ce(o, t):
        return nn.functional.cross_entropy(o, t, reduction="none")

    for inputs in ((x, z), {"x": x, "z": z}):
        with pytest.raises(UnsupportedModelError, match="not per-example separable|mixes"):
            GhostEngine().compute(model, ce, inputs, y, clip_weights(1.0),
                                  ParamGroups.flat(model))
        res = AutoEngine().compute(model, ce, inputs, y, clip_weights(1.0),
                                   ParamGroups.flat(model))
        assert res.engine_info["engine"] == "vmap" and res.engine_info["fallback"]


@pytest.mark.parametrize("engine", ["naive", "vmap", "ghost"])
def test_bad_leaves_are_refused_by_name(engine):
    model, x, y, loss_fn = make_case("dict-tagger", 4)
    eng = ENGINES[engine]()
    groups = ParamGroups.flat(model)
    with pytest.raises(ValueError, match=r"inputs\['flag'\] is a bool.*functools.partial"):
        eng.compute(model, loss_fn, {**x, "flag": True}, y, clip_weights(1.0), groups)
    with pytest.raises(ValueError, match=r"dimension 0.*inputs\['positions'\] differ"):
        eng.compute(model, loss_fn, {**x, "positions": torch.arange(T)[None]}, y,
                    clip_weights(1.0), groups)
    with pytest.raises(ValueError, match=r"targets\['mask'\] is a 0-d tensor"):
        eng.compute(model, loss_fn, x, {**y, "mask": torch.tensor(1)}, clip_weights(1.0), groups)


def test_none_leaves_pass_through():
    """``None`` carries no data: a dict input holding ``None`` calls ``model(..., key=None)``."""

    class Opt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: Tensor, extra: Tensor | None = None) -> Tensor:
            assert extra is None
            return self.fc(x)

    model = Opt().to(DT)
    x = torch.randn(5, 3, dtype=DT)
    y = torch.randint(0, 2, (5,))

    def ce(o, t):
        return nn.functional.cross_entropy(o, t, reduction="none")

    ref = VmapEngine().compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))
    for eng in (NaiveEngine(), VmapEngine(), GhostEngine()):
        res = eng.compute(model, ce, {"x": x, "extra": None}, y, clip_weights(1.0),
                          ParamGroups.flat(model))
        # (ghost's norms are bounds with a rounding factor for its public chunk size, 4096
        # examples: about 5e-13 relative in float64, vmap's for 256)
        assert_grads_close(res.grads, ref.grads, rtol=1e-11)
