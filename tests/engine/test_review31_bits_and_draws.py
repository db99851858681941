"""Thirty-first hostile review (of 3349503):

1. ``q, k, v = t`` runs ``Tensor.__iter__``, which calls ``self.unbind(0)``: a replaced
   ``Tensor.unbind`` mixing the batch ran inside a known tree (LOO 5.46 C, ghost and auto). The
   bodies of the iteration methods are followed now.
2. A position constant whose rows differ only in the sign of zero (``where(arange(B) % 2 == 1,
   -0.0, 0.0)``) passed the uniformity check (``torch.equal`` takes -0.0 for 0.0); ``atan2`` turned
   it into a sign by position: 7.87 C under ghost and auto. The check compares bits now.
3. A held generator passed POSITIONALLY (``torch.poisson(rate, g)``, ``torch.binomial(n, p, g)``,
   ``torch._standard_gamma(t, g)``): 5.5-7.0 C under vmap, auto and naive. Refused now.
4. Open (strict xfails): the forward re-seeding the DEFAULT generator (``torch.manual_seed(1234)``)
   before a draw makes vmap's batched draw a public sequence (5.51 C); under naive, Python state
   the model keeps outside its modules (a module-global counter) carries one example into the
   next (7.99 C). docs/engines.md, "The batch size in Python (open)".
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, UnsupportedModelError, VmapEngine
from tests.engine.helpers import DT, Head, loo_distance

D = 4


def _data(b: int = 8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, D, generator=g, dtype=DT) * 3, torch.randint(0, 3, (b,), generator=g)


def test_a_replaced_unbind_is_not_trusted_in_a_known_tree(monkeypatch):
    from dpclip.engine import ghost_forward
    from dpclip.models.architectures import TextTransformer

    torch.manual_seed(0)
    model = TextTransformer(50, 8, 3, d_model=16, heads=2, layers=1, ff=32)
    assert ghost_forward._known_tree(model) is not None
    original = torch.Tensor.unbind
    monkeypatch.setattr(torch.Tensor, "unbind",
                        lambda self, dim=0: original(self + 20 * self.sum(1, keepdim=True), dim))
    assert ghost_forward._known_tree(model) is None


class _NegZero(Head):
    def forward(self, x: Tensor) -> Tensor:
        b = x.shape[0]
        z = torch.where(torch.arange(b) % 2 == 1, torch.tensor(-0.0, dtype=x.dtype),
                        torch.tensor(0.0, dtype=x.dtype))[:, None]
        h = x[:, :1].abs() + 1.0
        return self.fc(x) * (3 * torch.atan2(h * z, -torch.ones_like(h)) / torch.pi)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_rows_that_differ_in_the_sign_of_zero_are_not_uniform(engine):
    """3349503: 7.87 C under ghost and auto."""
    x, y = _data()
    try:
        assert loo_distance(engine, _NegZero, x, y, 0.5) <= 1 + 1e-9
    except UnsupportedModelError:
        assert engine is GhostEngine


class _Positional(Head):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.g = torch.Generator().manual_seed(1234)

    def forward(self, x: Tensor) -> Tensor:
        ones = torch.ones(x.shape[0], 1, dtype=x.dtype)
        if self.how == "poisson":
            r = torch.poisson(ones, self.g)
        else:
            r = torch.binomial(ones * 4, ones * 0.5, self.g)
        return self.fc(x * ((r.remainder(2) < 0.5) * 2.0 - 1.0))


@pytest.mark.parametrize("how", ["poisson", "binomial"])
@pytest.mark.parametrize("engine", [VmapEngine, NaiveEngine], ids=["vmap", "naive"])
def test_a_held_generator_passed_positionally_is_refused(engine, how):
    x, y = _data()
    with pytest.raises(UnsupportedModelError, match="torch.Generator it holds"):
        loo_distance(engine, lambda: _Positional(how), x, y, 0.1)


class _Reseeds(Head):
    def forward(self, x: Tensor) -> Tensor:
        torch.manual_seed(1234)
        r = torch.rand(x.shape[0], 1, dtype=x.dtype)
        return self.fc(x * ((r < 0.5) * 2.0 - 1.0))


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_default_generator_reseeded_in_the_forward_is_refused_on_the_first_step(engine):
    """The proof's run of the forward left the generator seeded (fake draws do not advance it),
    so the real run's re-seed matched the state the draw check expected: ghost accepted the first
    step, LOO 5.51 C (a fresh engine per release); auto's probe step hid it. Now the proof
    leaves the default generators as it found them (generators.defaults_unchanged)."""
    x, y = _data(16)
    with pytest.raises(UnsupportedModelError, match="random generator's state was set"):
        loo_distance(engine, _Reseeds, x, y, 0.1)


@pytest.mark.xfail(strict=True, reason="open: a re-seeded default generator under vmap")
def test_a_default_generator_reseeded_in_the_forward_under_vmap():
    x, y = _data(16)
    try:
        assert loo_distance(VmapEngine, _Reseeds, x, y, 0.1) <= 1 + 1e-9
    except UnsupportedModelError:
        pass


_COUNT = [0]


class _Counts(Head):
    def forward(self, x: Tensor) -> Tensor:
        _COUNT[0] += 1
        return self.fc(x * (1.0 if _COUNT[0] % 2 else -1.0))


@pytest.mark.xfail(strict=True, reason="open: Python state outside the model under naive")
def test_a_global_counter_under_naive():
    x, y = _data(16)

    def make():
        _COUNT[0] = 0
        return _Counts()

    assert loo_distance(NaiveEngine, make, x, y, 0.1) <= 1 + 1e-9
