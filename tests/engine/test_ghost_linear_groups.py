"""Linear calls on positions with equal shapes are read together (``ghost_rules.linear_ghost_parts``:
the norms and rounding bounds of every call of the group in one set of operations, a Gram matrix
per distinct input). The group must give what each call gives alone (``_LinearRule.norms`` and
``bound_sq``), the rare rows included: examples whose terms cancel have their gradients formed
directly (``direct``, ``form`` of ``_position_bound_sq``), here in some calls of a group and not in
others, some examples and not others; and the bound must still hold on those examples."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dpclip.clipping import make_strategy
from dpclip.engine import GhostEngine, ParamGroups, ghost, ghost_rules

B, T = 6, 9
#: inputs whose cancelling rows fall in two calls of a group (call 0 example 2, call 1 example 0)
SEED = 2


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _ln_positions(h: Tensor) -> Tensor:
    """LayerNorm over the positions: on a constant sequence its gradient sums to 0 over them, so
    the projection's per-example gradient cancels while each term is large."""
    return F.layer_norm(h.transpose(1, 2), (h.shape[1],))


class Projections(nn.Module):
    """q, k, v read one input (one Gram matrix for three calls); o reads another input of the same
    shape (position-scaled: its terms do not cancel); w and w2 (no bias: a group of their own) read two
    more; ``wide`` has another output width (alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)
        self.o = nn.Linear(4, 3)
        self.w, self.w2 = nn.Linear(4, 3, bias=False), nn.Linear(4, 3, bias=False)
        self.wide = nn.Linear(4, 5)

    def forward(self, x: Tensor) -> Tensor:
        pos = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[None, :, None]
        h = self.o(x * pos)
        parts = [_ln_positions(self.q(x)), _ln_positions(self.k(x)), _ln_positions(self.v(x)),
                 _ln_positions(h), _ln_positions(self.w(x + 1.0)),
                 _ln_positions(self.w2(x - 2.0)), _ln_positions(self.wide(x)),
                 h.mean(1) * 0.01]  # (a bias gradient that the positions' norm does not remove)
        return torch.cat([p.flatten(1) for p in parts], 1)


def _inputs(seed: int, scale: float = 100.0) -> tuple[Tensor, Tensor]:
    """Examples 0-2 constant sequences (their terms cancel), 3-5 random."""
    g = torch.Generator().manual_seed(seed)
    const = (torch.randn(3, 1, 4, generator=g) * scale).expand(3, T, 4)
    rand = torch.randn(3, T, 4, generator=g) * scale
    x = torch.cat([const, rand]).contiguous()
    return x, torch.randint(0, 3 * T * 6 + 5 * 3 + 3, (B,), generator=g)


def _norm(grads: dict[str, Tensor]) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


class _Spy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.groups: list[int] = []
        self.inputs: list[int] = []  # distinct inputs per group
        self.formed = 0
        self.formed_in_groups: set[int] = set()  # calls of a group with formed rows
        self.inside = False
        parts, store = ghost.linear_ghost_parts, ghost_rules._store_formed

        def spy_parts(calls, rnd):
            self.groups.append(len(calls))
            self.inputs.append(len({c.a.data_ptr() for c in calls}))
            self.inside = True
            try:
                return parts(calls, rnd)
            finally:
                self.inside = False

        def spy_store(c, rows, grads):
            self.formed += int(rows.numel())
            if self.inside:
                self.formed_in_groups.add(id(c))
            return store(c, rows, grads)

        monkeypatch.setattr(ghost, "linear_ghost_parts", spy_parts)
        monkeypatch.setattr(ghost_rules, "_store_formed", spy_store)


def _run(groups_kind: str, mode: str, seed: int) -> tuple:
    torch.manual_seed(seed)
    model = Projections()
    x, y = _inputs(seed)
    groups = ParamGroups.flat(model) if groups_kind == "flat" else ParamGroups.per_layer(model)
    wf = lambda n: torch.clamp(0.1 / n, max=1.0)  # noqa: E731
    return GhostEngine(norm_mode=mode).compute(model, ce, x, y, wf, groups)


@pytest.mark.parametrize("groups_kind", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", ["ghost", "mixed"])
def test_a_group_gives_what_each_call_gives_alone(groups_kind: str, mode: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        spy = _Spy(m)
        together = _run(groups_kind, mode, SEED)
        assert sorted(spy.groups) == [2, 4], spy.groups  # q, k, v, o; w, w2 (wide: alone)
        # q, k and v read one input (one Gram matrix); o, w and w2 their own
        assert sorted(zip(spy.groups, spy.inputs)) == [(2, 2), (4, 2)], spy.inputs
        # the cancelling examples took the rare path inside the groups, in several calls
        assert len(spy.formed_in_groups) >= 2
    with monkeypatch.context() as m:
        m.setattr(ghost, "linear_ghost_key", lambda c, single: None)
        spy = _Spy(m)
        alone = _run(groups_kind, mode, SEED)
        assert spy.groups == [] and spy.formed > 0
    # the same operations on the same values, the reductions over the calls in another order
    torch.testing.assert_close(together.norms, alone.norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(together.weights, alone.weights, rtol=1e-6, atol=0)
    for n in alone.grads:
        torch.testing.assert_close(together.grads[n], alone.grads[n], rtol=1e-5, atol=1e-7)


def test_each_example_stays_within_the_clip_norm_when_read_in_a_group() -> None:
    torch.manual_seed(3)
    model = Projections()
    x, y = _inputs(3)
    groups = ParamGroups.flat(model)
    for name in ("fixed", "auto-v"):
        strat = make_strategy(name, {"clip_norm": 0.1 if name == "fixed" else 1.0})
        state = strat.init_state()
        c = strat.sensitivity(state)
        wf = lambda n, s=strat, st=state: s.weights(n, st)  # noqa: E731
        eng = GhostEngine(norm_mode="ghost")
        full = eng.compute(model, ce, x, y, wf, groups)
        for i in range(B):
            alone = eng.compute(model, ce, x[i:i + 1], y[i:i + 1], wf, groups)
            assert _norm(alone.grads) <= c, (name, i, _norm(alone.grads))
            keep = [j for j in range(B) if j != i]
            rest = eng.compute(model, ce, x[keep], y[keep], wf, groups)
            moved = _norm({n: full.grads[n].double() - rest.grads[n].double() for n in full.grads})
            slack = 2 * (B * 64 * T) * 2.0 ** -24 * B * c
            assert moved <= c + slack, (name, i, moved)


def test_norms_match_a_float64_per_example_loop() -> None:
    """Away from cancellation the bound is tight: the group's norms are the float64 per-example
    norms within a small relative margin."""
    torch.manual_seed(5)
    model = Projections()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, T, 4, generator=g)
    y = torch.randint(0, 3 * T * 6 + 5 * 3 + 3, (B,), generator=g)
    res = GhostEngine(norm_mode="ghost").compute(model, ce, x, y, lambda n: torch.ones_like(n),
                                                 ParamGroups.flat(model))
    m64 = Projections()
    m64.load_state_dict(model.state_dict())
    m64 = m64.double()
    want = []
    for i in range(B):
        m64.zero_grad()
        ce(m64(x[i:i + 1].double()), y[i:i + 1]).sum().backward()
        want.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in m64.parameters())))
    want_t = torch.tensor(want)
    got = res.norms.double()
    assert bool((got >= want_t * (1 - 1e-9)).all()), (got, want_t)
    assert bool((got <= want_t * (1 + 1e-3)).all()), (got, want_t)
