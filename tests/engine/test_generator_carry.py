"""A call cannot carry its examples into the next call through torch's random generators
(issue 31; ``dpclip.engine.generators``).

Found by the hostile review of the chunk of one (25003bb): at the end of its forward, with torch
functions and Python dispatch off (and not during the proof), a model writes its example into the
default CPU generator, by seeding it from the example (``_Seeds``: the next call's dropout masks)
or by planting the example's value in the generator's cached normal sample (``_Plants``: row 0 of
the next call's ``randn``). Accepted on 25003bb by ghost and ``auto`` (LOO 1.63 C and 2.51 C at
``max_physical_batch=1`` and over steps of one; 2.66 C against the replace-one bound 2 C between
steps of two), and after each ``make_private`` step the default generator held a training
example's value. Now every chunk that runs user code (and every chunk of the vmap engine) runs
under generators of its own, seeded from one draw of the caller's generator, and the caller's
state is put back after it.

The measurements couple the randomness the mechanism is entitled to: the caller's generator is
seeded identically before each of the two runs compared, so the runs draw the same per-chunk
seeds; only what one call carries into another can then move the release.
"""

from __future__ import annotations

import struct

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine.generators import OwnGenerators
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data


def _modes_off():
    return (torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch())


def _value(x: Tensor) -> float:
    """The first example's feature sum, read past vmap's wrappers (under ``vmap`` too)."""
    x = _unwrapped(x)
    return float(x.reshape(x.shape[0], -1)[0].sum())


class _Seeds(nn.Module):
    """Dropout, then the default generator seeded from the example (``honest``: a constant)."""

    def __init__(self, honest: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 16), nn.Linear(16, 3)
        self.honest = honest

    def forward(self, x: Tensor) -> Tensor:
        out = self.fc2(F.dropout(torch.tanh(self.fc1(x)), p=0.5, training=True))
        f, d = _modes_off()
        with f, d:
            seed = 1234
            if not self.honest and not is_fake(x):
                seed = int(abs(_value(x)) * 1e6) % (2 ** 31)
            torch.manual_seed(seed)
        return out


#: where torch 2.13's CPU generator state keeps its cached normal sample and its valid flag
_NORMAL_Y, _NORMAL_VALID = slice(5024, 5032), slice(5040, 5044)


class _Plants(nn.Module):
    """Adds ``0.5 * randn(B, 1)``, then writes the example's feature sum into the default
    generator's cached normal sample (``honest``: 0.7)."""

    def __init__(self, honest: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.honest = honest

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) + 0.5 * torch.randn(x.shape[0], 1, dtype=x.dtype)
        out = self.fc2(torch.tanh(h))
        f, d = _modes_off()
        with f, d:
            if not is_fake(x):
                _plant(0.7 if self.honest else _value(x))
        return out


def _unwrapped(x: Tensor) -> Tensor:
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def _plant(v: float) -> None:
    with torch._C._DisableFuncTorch():  # (also under vmap)
        st = bytearray(torch.get_rng_state().numpy().tobytes())
        st[_NORMAL_Y] = struct.pack("d", v)
        st[_NORMAL_VALID] = struct.pack("i", 1)
        torch.set_rng_state(torch.frombuffer(st, dtype=torch.uint8).clone())


def test_the_planted_sample_is_what_the_next_draw_returns():
    """The attack's premise on this torch (else the test below proves nothing)."""
    torch.manual_seed(0)
    torch.randn(1)
    _plant(3.25)
    assert float(torch.randn(1, dtype=torch.float64)) == 3.25


ATTACKS = {"seeds": _Seeds, "plants": _Plants}
ENGINES = {"ghost": GhostEngine, "auto": AutoEngine, "vmap": VmapEngine}


def _release(engine, model, x, y) -> Tensor:
    torch.manual_seed(7)  # the caller's generator: the same before every run compared
    return clipped_sum(engine, model, ce, x, y)[0]


def _replace_first_chunks(engine, model) -> float:
    """``max_physical_batch=1``: the release moves by at most ``2 C`` when example 0 is replaced
    (the later chunks draw the same seeds in both runs)."""
    x, y = data()
    x2 = x.clone()
    x2[0] = -3 * x[0] + 1
    return float((_release(engine, model, x, y) - _release(engine, model, x2, y)).norm()) / C


def _next_step_moved(engine, model) -> float:
    """How far a step of two examples moves when the step of one before it changes its example
    (the caller's generator seeded identically before each sequence; sound: 0)."""
    x, y = data()
    got = []
    for first in (0, 1):
        torch.manual_seed(7)
        clipped_sum(engine, model, ce, x[first:first + 1], y[first:first + 1])
        got.append(clipped_sum(engine, model, ce, x[2:4], y[2:4])[0])
    return float((got[0] - got[1]).norm()) / C


@pytest.mark.parametrize("honest", [False, True], ids=["attack", "honest"])
@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_call_cannot_reach_the_next_through_the_generator(engine, attack, honest):
    torch.manual_seed(0)
    model = ATTACKS[attack](honest).to(DT)
    eng = ENGINES[engine]
    assert _replace_first_chunks(eng(max_physical_batch=1), model) <= 2 + 1e-9
    assert _next_step_moved(eng(), model) <= 1e-12


def test_before_the_fix_the_measurement_sees_the_carry():
    """The measurement is not blind: the same two calls without the engine's generators (the
    model's forward run by hand) carry the first example into the second call's draws."""
    torch.manual_seed(0)
    model = _Plants().to(DT)
    x, _ = data()
    outs = []
    for first in (0, 1):
        torch.manual_seed(7)
        model(x[first:first + 1])
        outs.append(model(x[2:4]))
    assert not torch.equal(outs[0], outs[1])
    torch.manual_seed(7)
    model(x[:1])
    assert float(torch.randn(1, dtype=torch.float64)) == float(x[0].sum())


@pytest.mark.parametrize("engine", ["ghost", "auto", "vmap"])
def test_the_callers_generator_advances_by_one_draw_per_chunk(engine):
    """What a chunk wrote into the generator is gone after the step: the caller's generator is
    where one seed draw per chunk leaves it (a chunk of the closed program draws none)."""
    torch.manual_seed(0)
    model = _Plants().to(DT)
    x, y = data()
    torch.manual_seed(11)
    clipped_sum(ENGINES[engine](max_physical_batch=3), model, ce, x, y)
    after = torch.get_rng_state()
    torch.manual_seed(11)
    for _ in range(3):  # chunks of 3, 3 and 2 examples
        torch.randint(0, (1 << 62) - 1, (), dtype=torch.int64)
    assert torch.equal(after, torch.get_rng_state())


def test_own_generators_restore_and_reseed():
    """The context's contract: the caller's CPU state after it is the state after one draw;
    inside, the state does not depend on what the caller's cached sample held; ``reseed`` starts
    the generators anew; an adopted generator is restored too."""
    torch.manual_seed(3)
    torch.randn(1)  # a cached sample in the caller's state
    _plant(9.0)
    mine = torch.Generator().manual_seed(5)
    kept = mine.get_state()
    with OwnGenerators() as gens:
        first = torch.randn(4, dtype=torch.float64)
        assert 9.0 not in first.tolist()
        gens.adopt([mine])
        torch.rand(3, generator=mine)
        gens.reseed()
        again = torch.randn(4, dtype=torch.float64)
        assert not torch.equal(first, again)
        torch.manual_seed(99)
    assert torch.equal(mine.get_state(), kept)
    assert float(torch.randn(1, dtype=torch.float64)) == 9.0  # the caller's own sample, kept
