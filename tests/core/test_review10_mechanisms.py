"""Tenth hostile review (of e00478f): the mechanisms around the engines. Each case failed there:

* ``dp_step`` with a flat strategy and several parameter groups: the flat weights act
  elementwise on per-group norms (B, G), so each group was clipped to C while the sensitivity
  stayed C (LOO 2.28 S with 6 groups; sqrt(G) C at worst). Now a ValueError.
* Batch clipping (``unit=bc`` / ``gbc``) and AdaClip's transformed per-example gradients ran the
  model outside the isolation the engines give each chunk: a float attribute carried from one
  unit (or call) to the next moved a GBC release 2.90 C against the declared 2 C, a BC step's
  next release 2.00 C, an AdaClip release 1.92 against sensitivity 1. Now refused (entry 109).
* Lip-DP-SGD certified the layers' classes and ignored their hooks and instance attributes: a
  forward pre-hook x50 gave 9.3 times the certified sensitivity, an instance forward 37 times.
  Now the bound analysis refuses them (and global module hooks).
* ``make_private``'s checkpoint, resumed on a neighbouring dataset, replayed the same noise: the
  two releases differed by the noise-free difference (0.91 C). Now the checkpoint holds the
  data's fingerprint and a resume on other data is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

import dpclip
from dpclip.clipping.adaclip import AdaClip
from dpclip.clipping.base import StepContext
from dpclip.clipping.fixed import FixedClip
from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, ParamGroups, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.summed import SummedEngine
from dpclip.lipschitz.bounds import UnsupportedLayerError
from dpclip.lipschitz.strategy import LipDpSgd
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import bound_step, dp_step
from dpclip.training.units import MiniSetSampler, UnitConfig
from tests.engine.test_isolation import _first

DT = torch.float64
C = 0.5
ENGINES = [GhostEngine, AutoEngine, VmapEngine, NaiveEngine]
IDS = ["ghost", "auto", "vmap", "naive"]


def ce(o: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(o, y, reduction="none")


def _data(b: int = 8, d: int = 5) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, d, generator=g, dtype=DT) * 3, torch.randint(0, 3, (b,), generator=g)


def _ctx(ebs: float = 8.0) -> StepContext:
    return StepContext.at(0, steps_per_epoch=10, total_steps=100, expected_batch_size=ebs,
                          base_noise_multiplier=0.0)


def _step(engine, model, x, y, strategy, groups, loss=ce, unit=None, sampler=None, ebs=8.0):
    out = dp_step(model, x, y, loss_fn=loss, strategy=strategy, state=strategy.init_state(),
                  engine=engine, groups=groups, sampler=sampler or PoissonSampler(1000, ebs),
                  base_noise_multiplier=0.0, ctx=_ctx(ebs),
                  generator=torch.Generator().manual_seed(0), unit=unit)
    return torch.cat([g.reshape(-1) for g in out.grads.values()]) * ebs, out


@pytest.mark.parametrize("engine", ENGINES, ids=IDS)
def test_a_flat_strategy_with_several_groups_is_refused(engine):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    names = [n for n, _ in model.named_parameters()]
    groups = ParamGroups(tuple(names), tuple((n,) for n in names))  # one group per parameter
    x, y = _data()
    with pytest.raises(ValueError, match="clips the whole gradient .* 4 parameter groups"):
        _step(engine(), model, x, y, FixedClip(C), groups)


class _Carry(nn.Module):
    """Keeps a sign read from the data in a plain float, used by the next unit or call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.carry = 1.0

    def forward(self, x: Tensor) -> Tensor:
        s = self.carry
        self.carry = 1.0 if float(x.detach()[:, 0].sum()) >= 0 else -1.0
        return s * self.lin(x)


def _linear_loss(o: Tensor, y: Tensor) -> Tensor:
    return o.sum(dim=1)


@pytest.mark.parametrize("unit", ["gbc", "bc"])
def test_batch_clipping_units_run_isolated(unit):
    g = torch.Generator().manual_seed(0)
    if unit == "gbc":
        x = torch.randn(3, 2, 5, generator=g, dtype=DT)
        config, sampler = UnitConfig(unit="gbc", miniset_size=2), MiniSetSampler(12, 2, 3)
    else:
        x = torch.randn(1, 4, 5, generator=g, dtype=DT)
        config, sampler = UnitConfig(unit="bc"), PoissonSampler(1000, 4)
    x[..., 0] = -1.0  # the forward's carry flips to -1
    y = torch.zeros(x.shape[:2], dtype=torch.long)
    torch.manual_seed(0)
    model = _Carry().to(DT)
    with pytest.raises(UnsupportedModelError, match="attribute 'carry'|into Python"):
        _step(VmapEngine(), model, x, y, FixedClip(C), ParamGroups.flat(model),
              loss=_linear_loss, unit=config, sampler=sampler)
    assert model.carry == 1.0  # put back


class _KeepsAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.k = 0.0

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) * (-3.0 if self.k > 10 else 1.0)
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            if not is_fake(x):
                self.k = _first(x)
        return self.fc2(torch.tanh(h))


@pytest.mark.parametrize("engine", [AutoEngine, VmapEngine, NaiveEngine],
                         ids=["auto", "vmap", "naive"])
def test_adaclip_chunks_run_isolated(engine):
    torch.manual_seed(0)
    model = _KeepsAttr().to(DT)
    x, y = _data()
    x[0] = x[0].abs() + 4.0
    with pytest.raises(UnsupportedModelError, match="attribute 'k'"):
        _step(engine(), model, x, y, AdaClip(C), ParamGroups.flat(model))


def _lip_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    if kind == "pre-hook":
        m[0].register_forward_pre_hook(lambda mod, a: (a[0] * 50.0,))
    elif kind == "forward-hook":
        m[0].register_forward_hook(lambda mod, a, o: 50.0 * o)
    elif kind == "instance-forward":
        lin = m[2]
        lin.forward = lambda t: 50.0 * nn.Linear.forward(lin, t)
    return m


def _lip_step(m: nn.Module, strat, xs: Tensor, ys: Tensor, engine=None):
    state = strat.begin_step(strat.init_state(), _ctx())
    out = bound_step(m, xs, ys, loss_fn=strat.loss(), strategy=strat, state=state,
                     engine=engine or SummedEngine(), groups=ParamGroups.flat(m),
                     sampler=PoissonSampler(1000, 8.0), base_noise_multiplier=0.0,
                     ctx=_ctx(), generator=torch.Generator().manual_seed(0))
    return torch.cat([g.reshape(-1) for g in out.grads.values()]) * 8.0, out


@pytest.mark.parametrize("kind", ["pre-hook", "forward-hook", "instance-forward"])
def test_the_lipschitz_bound_refuses_code_beside_the_layer_class(kind):
    m = _lip_model(kind)
    strat = LipDpSgd(input_norm=1.0).bind(m, (5,))
    x, y = _data()
    with pytest.raises(UnsupportedLayerError, match="not supported by the Lipschitz bound"):
        _lip_step(m, strat, x, y)


def test_the_lipschitz_bound_refuses_a_global_module_hook():
    m = _lip_model("none")
    strat = LipDpSgd(input_norm=1.0).bind(m, (5,))
    x, y = _data()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, a, o: None)
    try:
        with pytest.raises(UnsupportedLayerError, match="a global module hook"):
            _lip_step(m, strat, x, y)
    finally:
        handle.remove()


def test_the_lipschitz_bound_holds_without_them():
    """The control: the same model without hooks stays within its certified sensitivity."""
    m = _lip_model("none")
    strat = LipDpSgd(input_norm=1.0).bind(m, (5,))
    x, y = _data()

    def released(xs, ys):
        return _lip_step(m, strat, xs, ys)

    full, out = released(x, y)
    worst = max(float((full - released(x[[i for i in range(8) if i != j]],
                                       y[[i for i in range(8) if i != j]])[0]).norm())
                for j in range(8))
    assert worst <= out.sensitivity * (1 + 1e-9)


def test_a_checkpoint_resumes_only_on_its_own_data():
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(16, 5, generator=g, dtype=DT)
    ys = torch.randint(0, 3, (16,), generator=g)
    other = xs.clone()
    other[0] = 5 * other[0]

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)

    def run(data):
        return dpclip.make_private(build(), None, (data, ys), noise_multiplier=1.0, steps=50,
                                   batch_size=15, engine="vmap", verbose=False)

    dp = run(xs)
    bx, by = dp.sample()
    dp.backward(bx, by)
    ck = dp.state_dict()
    assert isinstance(ck["data_fingerprint"], str)
    run(xs).load_state_dict(ck)  # the same data: resumes
    with pytest.raises(ValueError, match="written for other training data"):
        run(other).load_state_dict(ck)
    old = {k: v for k, v in ck.items() if k != "data_fingerprint"}
    with pytest.raises(ValueError, match="without a data fingerprint"):
        run(xs).load_state_dict(old)
