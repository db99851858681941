"""make_private with tuple and dict inputs: Datasets yielding ``(dict_of_tensors, label)`` and
``((x1, x2), y)`` tensors, per-example sequence losses with padding masks, regression losses,
per-layer groups, equality with ``dp_step`` on the naive engine (float64) and resume."""

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from dpclip.training import private as P
from dpclip.clipping import make_strategy
from dpclip.engine import ParamGroups, get_engine
from dpclip.randomness import PrivateRandomness
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import dp_step

VOCAB, T = 17, 5


class Classifier(nn.Module):
    """``model(input_ids=..., attention_mask=...)``: masked mean of embeddings, LayerNorm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        m = attention_mask.to(self.head.weight.dtype).unsqueeze(-1)
        pooled = (self.emb(input_ids) * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.head(self.norm(pooled))


def _sequences(n=240, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    ids = 1 + y[:, None] * 8 + torch.randint(0, 8, (n, T), generator=g)
    lengths = torch.randint(2, T + 1, (n, 1), generator=g)
    mask = torch.arange(T)[None, :] < lengths
    return ids.masked_fill(~mask, 0), mask, y


class DictPairs(Dataset):
    """A map-style Dataset yielding ``({"input_ids": (T,), "attention_mask": (T,)}, label)``."""

    def __init__(self, ids, mask, y):
        self.ids, self.mask, self.y = ids, mask, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}, self.y[i]


def _ce(o, t):
    return nn.functional.cross_entropy(o, t, reduction="none")


def test_dict_dataset_step_equals_dp_step_in_float64_with_per_layer_groups():
    ids, mask, y = _sequences()
    torch.manual_seed(0)
    model = Classifier().double()
    ref = copy.deepcopy(model)
    dp = P.make_private(model, None, DictPairs(ids, mask, y), loss_fn=_ce, strategy="per-layer",
                        strategy_params={"clip_norm": 0.7}, noise_multiplier=1.0, epochs=1,
                        batch_size=24, delta=1e-5, engine="auto", reproducible_noise=True,
                        seed=5)
    xb, yb = dp.sample()
    assert set(xb) == {"input_ids", "attention_mask"} and xb["input_ids"].shape[1:] == (T,)
    dp.backward(xb, yb)
    assert dp.engine_info["engine"] == "ghost" and dp.engine_info["fallback"] is None
    assert len(dp.groups) == 3  # emb, norm, head
    # the same step by hand on the naive engine
    rng = PrivateRandomness.reproducible(5)
    PoissonSampler(len(y), 24.0).sample(rng.sampling)
    strat = make_strategy("per-layer", {"clip_norm": 0.7}).bind_groups(dp.groups.names)
    out = dp_step(ref, xb, yb, loss_fn=_ce, strategy=strat, state=strat.init_state(),
                  engine=get_engine("naive"), groups=ParamGroups.from_spec(ref, "layer"),
                  sampler=PoissonSampler(len(y), 24.0), base_noise_multiplier=1.0,
                  ctx=dp._plan.ctx(0, 1.0), generator=rng.noise)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, out.grads[n], rtol=1e-10, atol=1e-12)
    assert dp.ledger.entries[0][0] == out.event


def test_dict_inputs_train_resume_and_meet_the_target():
    ids, mask, y = _sequences()
    inputs = {"input_ids": ids, "attention_mask": mask}

    def fresh():
        torch.manual_seed(0)
        model = Classifier()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        return P.make_private(model, opt, (inputs, y), loss_fn=_ce, strategy="quantile",
                              epsilon=4.0, epochs=3, batch_size=48, delta=1e-4)

    a = fresh()
    for xb, yb in a.loader:
        a.step(xb, yb)
    ck = copy.deepcopy(a.state_dict())
    b, c = fresh(), fresh()
    b.load_state_dict(ck)
    c.load_state_dict(copy.deepcopy(ck))
    for dp in (b, c):
        for _ in range(dp.epochs):
            for xb, yb in dp.loader:
                dp.step(xb, yb)
    for p, q in zip(b.model.parameters(), c.model.parameters()):
        assert torch.equal(p, q)
    assert b.ledger == c.ledger and b.steps == b.total_steps
    assert b.epsilon() <= 4.0 + 1e-9 and b.describe()["engine"] == "ghost"
    with torch.no_grad():
        acc = (b.model(**inputs).argmax(1) == y).float().mean().item()
    assert acc > 0.8  # the classes use disjoint halves of the vocabulary


class TwoInputRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 8)
        self.b = nn.Linear(2, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return self.out(torch.tanh(self.a(x1) + self.b(x2))).squeeze(1)


def test_tuple_inputs_with_a_regression_loss():
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(400, 3, generator=g), torch.randn(400, 2, generator=g)
    y = x1[:, 0] - 0.5 * x2[:, 1]
    torch.manual_seed(0)
    model = TwoInputRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    dp = P.make_private(model, opt, ((x1, x2), y), loss_fn=lambda o, t: (o - t) ** 2,
                        strategy="fixed", strategy_params={"clip_norm": 1.0}, epsilon=5.0,
                        epochs=4, batch_size=50, delta=1e-4)
    with torch.no_grad():
        before = ((model(x1, x2) - y) ** 2).mean().item()
    for _ in range(dp.epochs):
        for (b1, b2), yb in dp.loader:  # unpacked and packed again: the same tensors
            assert b1.shape[0] == b2.shape[0] == yb.shape[0]
            dp.step((b1, b2), yb)
    with torch.no_grad():
        after = ((model(x1, x2) - y) ** 2).mean().item()
    assert after < 0.5 * before
    assert dp.describe()["engine"] == "ghost" and dp.steps == dp.total_steps
    d3 = P.make_private(model, None, ((x1, x2), y), noise_multiplier=1.0, steps=1,
                        batch_size=50, delta=1e-4, loss_fn=lambda o, t: (o - t) ** 2)
    (c1, c2), cy = d3.sample()
    with pytest.raises(ValueError, match="just drawn"):
        d3.backward((c1.clone(), c2), cy)  # a copy is not the drawn batch


def test_bad_structured_data_is_refused_by_name():
    ids, mask, y = _sequences(40)
    with pytest.raises(ValueError, match=r"different batch sizes.*make_private: pass"):
        P.make_private(Classifier(), None, ({"input_ids": ids, "attention_mask": mask[:30]}, y),
                       noise_multiplier=1.0, epochs=1, delta=1e-3)

    class WithText(DictPairs):
        def __getitem__(self, i):
            x, t = super().__getitem__(i)
            return {**x, "text": "secret words"}, t

    dp = P.make_private(Classifier(), None, WithText(ids, mask, y), loss_fn=_ce,
                        noise_multiplier=1.0, epochs=1, batch_size=10, delta=1e-3)
    with pytest.raises(ValueError,
                       match=r"make_private: inputs\[.text.\]\[0\] is a str, not a tensor"):
        dp.sample()


def test_batch_clipping_units_refuse_tuple_inputs_by_name():
    g = torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(100, 3, generator=g), torch.randn(100, 2, generator=g)
    y = torch.randn(100, generator=g)
    dp = P.make_private(TwoInputRegressor(), None, ((x1, x2), y),
                        loss_fn=lambda o, t: (o - t) ** 2, strategy_params={"unit": "bc"},
                        noise_multiplier=1.0, steps=2, batch_size=20, delta=1e-3)
    xb, yb = dp.sample()
    with pytest.raises(ValueError, match="unit=bc .*tuple or dict inputs run with unit=ic"):
        dp.backward(xb, yb)
