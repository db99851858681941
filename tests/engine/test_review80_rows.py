"""Eightieth hostile review: torch's CPU kernels pick their code by the number of rows (MKL's
product with one output column rounds its last rows otherwise, its products of 3 and 4 rows round
every row otherwise, a reduction with the batch innermost in memory sums the last columns on
another path), so an example's computed gradient depended on how many others shared its chunk:
up to 5.1 C through a zero-variance LayerNorm (``benchmarks/rounding_loo.py`` models
``one-column``, ``few-rows``, ``batch-innermost``). The engines now run every chunk on a multiple
of 32 rows, copies of its first example after it (``dpclip.engine.batch.padded_rows``)."""

import pytest
import torch
import torch.nn.functional as F

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.batch import ROW_BLOCK, pad_rows, padded_rows
from tests.engine.helpers import benchmark_module

rounding_loo = benchmark_module("rounding_loo")

TOL = 1 + 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
@pytest.mark.parametrize("model,batch", [("one-column", 12), ("one-column", 64),
                                         ("few-rows", 4), ("batch-innermost", 4),
                                         ("batch-innermost", 33)])
def test_a_stage_that_rounds_by_the_row_count_no_longer_moves_the_others(engine, model, batch):
    """Before: one-column 2.12 C (batch 12) and 2.64 C (64); few-rows 1.014 C (4);
    batch-innermost 1.52 C (4) and 5.10 C (32) on ghost; vmap alike where it moved."""
    assert rounding_loo.loo(engine, batch, torch.float32, model_name=model) <= TOL


def test_padded_rows_are_multiples_of_the_block_and_pad_rows_appends_copies():
    assert [padded_rows(n) for n in (1, 2, 31, 32, 33, 64, 65)] == [32, 32, 32, 32, 64, 64, 96]
    t = torch.arange(6.0).view(3, 2)
    p = pad_rows(t, ROW_BLOCK)
    assert p.shape == (ROW_BLOCK, 2) and torch.equal(p[:3], t)
    assert torch.equal(p[3:], t[:1].expand(ROW_BLOCK - 3, 2))
    assert pad_rows(t, 3) is t


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_the_copies_are_invisible(engine):
    """The strategy sees the real examples' norms only, the copies add nothing to the sum, the
    loss is the real examples' (float64 per-example loop as the oracle)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()
    x, y = torch.randn(5, 5, dtype=torch.float64), torch.randint(0, 3, (5,))
    seen = []

    def weights(norms):
        seen.append(norms.shape[0])
        return torch.clamp(0.5 / norms, max=1.0)

    def ce(o, t):
        return F.cross_entropy(o, t, reduction="none")

    res = get_engine(engine).compute(model, ce, x, y, weights, ParamGroups.flat(model))
    assert seen and set(seen) == {5}
    want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    loss = 0.0
    for i in range(5):
        li = ce(model(x[i:i + 1]), y[i:i + 1]).sum()
        loss += float(li)
        gs = torch.autograd.grad(li, list(model.parameters()))
        norm = torch.sqrt(sum((g ** 2).sum() for g in gs))
        w = min(1.0, 0.5 / float(norm))
        for (n, _), g in zip(model.named_parameters(), gs):
            want[n] += w * g
    for n, g in res.grads.items():
        torch.testing.assert_close(g.double(), want[n], rtol=1e-9, atol=1e-12)
    assert res.norms.numel() == 5 and res.weights.numel() == 5
    assert abs(res.loss_sum - loss) < 1e-9


def _adaclip_loo(engine_name: str, batch: int, model_name: str) -> float:
    """Leave-one-out of AdaClip's released (whitened) sum, sensitivity 1: its per-example
    gradients come from ``vmap_per_example_grads`` (``dp_step``'s ``transformed_sum``)."""
    from dpclip.clipping.adaclip import AdaClip
    from dpclip.training.step import transformed_sum

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 2, rounding_loo.D, generator=g) * rounding_loo.SCALE
    y = torch.randint(0, 5, (batch,), generator=g)
    torch.manual_seed(0)
    model = rounding_loo.MODELS[model_name]()
    engine, strategy = get_engine(engine_name), AdaClip(initial_clip_norm=rounding_loo.C)
    state, groups = strategy.init_state(), ParamGroups.flat(model)

    def total(xs, ys):
        res = transformed_sum(engine, strategy, state, model, rounding_loo.ce, xs, ys, groups)
        return torch.cat([t.reshape(-1) for t in res.grads.values()]).double()

    total(x, y)
    full = total(x, y)
    return max(float((full - total(x[[i for i in range(batch) if i != j]],
                                    y[[i for i in range(batch) if i != j]])).norm())
               for j in range(batch))


@pytest.mark.parametrize("engine", ["vmap", "auto"])
@pytest.mark.parametrize("model,batch", [("one-column", 12), ("batch-innermost", 4)])
def test_adaclips_per_example_gradients_run_on_the_row_block_too(engine, model, batch):
    """Eighty-first hostile review: AdaClip's gradients (vmap_per_example_grads) were not padded:
    2.12 (one-column, 12) and 1.59 (batch-innermost, 4) times its sensitivity."""
    assert _adaclip_loo(engine, batch, model) <= TOL


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_a_model_sized_by_the_batch_fails_with_its_own_error_and_a_note(engine):
    """A layer as wide as the batch cannot run on the padded rows: the model's own error (type and
    text), with a note that says what the engine changed and no number."""

    class SizedByTheBatch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = torch.nn.Linear(5, 5)  # (the 5 examples as features)
            self.head = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.mix(x.t()).t())

    model = SizedByTheBatch()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        get_engine(engine).compute(model, lambda o, t: F.cross_entropy(o, t, reduction="none"),
                                   x, y, lambda n: torch.clamp(1 / n, max=1.0),
                                   ParamGroups.flat(model))
    notes = getattr(info.value, "__notes__", [])
    assert any("multiple of 32 rows" in n and not any(c.isdigit() for c in n.split("32")[1])
               for n in notes), notes
