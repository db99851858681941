"""Hundred-and-nineteenth hostile review: a frame-evaluation callback (PEP 523,
``torch._C._dynamo.eval_frame.set_eval_frame``) set by the forward and left on: Python hands it
every frame the engine and the release run, with their locals, after every check; it scaled the
gradients by 50 (LOO 50 C under every engine) or cancelled the noise through make_private. Now a
step refuses it when it starts and when it ends (and takes it out).

Hundred-and-twentieth: the ghost engine's rounding factor of the norms was taken for the chunk's
padded row count, a function of the realised batch size: every example's norm moved when the
batch crossed a multiple of 32 rows, so the quantile count flipped every bit at a threshold (513
times its sensitivity under ghost, auto and compiled) and the other examples' weights moved the
release (1.13 C at B = 65,536). Now it is taken for the chunk's public size
(``max_physical_batch``, else 4096 examples, chunks beyond)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError

_EF = torch._C._dynamo.eval_frame


def _loss(o, y):
    return nn.functional.cross_entropy(o, y, reduction="none")


class _SetsCallback(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3).double()

    def forward(self, x):
        # (the bytecode debugger callback, read by the same check: a frame-evaluation callback
        # itself would mark the code objects it sees for every later torch.export in the
        # process; review 119's script measures that one)
        _EF.set_bytecode_debugger_callback(lambda *a: None)
        return self.fc(x)


@pytest.mark.parametrize("engine", ["ghost", "auto", "vmap", "naive"])
def test_a_frame_callback_left_by_the_forward_is_refused(engine):
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    model = _SetsCallback()
    try:
        with pytest.raises(UnsupportedModelError, match="frame-evaluation callback"):
            get_engine(engine).compute(model, _loss, x, y, lambda n: torch.clamp(1 / n, max=1.0),
                                       ParamGroups.flat(model))
    finally:
        _EF.set_bytecode_debugger_callback(None)
    assert _EF.get_bytecode_debugger_callback() is None  # (taken out by the engine)


@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_the_norms_do_not_depend_on_the_realised_batch_size(engine):
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    x = torch.randn(40, 8)
    x = x / x.norm(dim=1, keepdim=True)
    y = torch.zeros(40, dtype=torch.long)
    eng = get_engine(engine)
    got = {}
    for b in (32, 33):  # (32 -> 64 padded rows)
        res = eng.compute(model, lambda o, t: o[:, 0], x[:b], y[:b],
                          lambda n: torch.clamp(1.0 / n, max=1.0), ParamGroups.flat(model))
        got[b] = res.norms[:32]
    assert torch.equal(got[32], got[33])  # (2e-6 relative apart before: every bit flipped)


class _TiedCancel(nn.Module):
    """Hundred-and-twenty-first hostile review: an Embedding tied to the output Linear, larger
    than the tied path forms exactly (its exact bound from the uses' cross terms), with a loss
    whose two uses nearly cancel: the bound's error terms (for the padded realised rows before)
    dominate the norm, and 32 ulps of the factor moved every norm by 1 %: 3.8 C."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(2100, 32)
        self.out = nn.Linear(32, 2100, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        z = self.out(h)
        return z.gather(2, x.unsqueeze(2))[:, 0, 0] - 0.995 * h.square().sum((1, 2))


@pytest.mark.parametrize("engine", ["ghost", "auto"])
def test_a_tied_parameter_s_bound_does_not_depend_on_the_realised_batch_size(engine):
    x = torch.full((40, 1), 5, dtype=torch.long)
    y = torch.zeros(40)
    model = _TiedCancel()
    eng = get_engine(engine)
    got = {}
    for b in (32, 33):
        res = eng.compute(model, lambda o, t: o, x[:b], y[:b],
                          lambda n: torch.clamp(1e-6 / n, max=1.0), ParamGroups.flat(model))
        got[b] = res.norms[:32]
    assert torch.equal(got[32], got[33])  # (1.3 % apart before)


@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_a_closed_program_s_dropout_draws_from_the_secret_chunk_seeds(engine):
    """Hundred-and-twenty-third hostile review: an ``nn.Sequential`` with a Dropout (a closed
    program: known modules, known loss, a strategy of dpclip's own) ran without the chunk's own
    generators, so its masks came from torch's public generator, by row position: 4.5 C through
    make_private. Now the masks follow the chunk seeds (the run's private randomness): with the
    public generator the same and only the chunk seeds other, the release moves."""
    import dpclip

    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g)

    def release(salt: bytes) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 3))
        dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (xs, ys),
                                 noise_multiplier=1.0, steps=2, batch_size=16.0, engine=engine,
                                 reproducible_noise=True, seed=7, verbose=False)
        dp.rng._model_salt = dp.rng._model_salt + salt  # (the chunk seeds only, not the noise)
        xb, yb = dp.sample()
        torch.manual_seed(2024)  # (the public generator: the same both times)
        dp.backward(xb, yb)
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    assert not torch.equal(release(b""), release(b"x"))  # (equal before: public masks)
