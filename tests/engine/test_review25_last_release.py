"""Twenty-fifth hostile review (of c62e6b2), failing there: the last chunk's tensors were released
after the step's isolation had ended (at the end of ``GhostEngine._guarded``). A finalizer run at
that release wrote a value from the step's data into the model (a Python attribute, through
``dp_step``; a buffer, through ``compute``), and the next step read it: on identical data the
second step's release moved by 2.33 times the per-step sensitivity depending on whether an example
was in the first step (the reviewer's measurement). Now the last chunk's tensors are released
inside its isolation (an attribute left changed is refused and put back) and a parameter or buffer
written then is refused.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import Tensor, nn

from dpclip.clipping import FixedClip, StepContext
from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from dpclip.noise import make_generator
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import dp_step
from tests.engine.helpers import DT, Scale, ce, clip_weights, is_real, outlier_batch
from tests.engine.test_review24_between_chunks import _CarriesBetweenChunks

C = 0.5


def _write(mod: nn.Module, d: Tensor) -> None:
    if is_real(d):
        mod.scale = 1000.0 if float(d.abs().amax()) > 20 else 1.0


class _AttributeAfterTheStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc0, self.p, self.fc1 = nn.Linear(5, 4).to(DT), Scale(), nn.Linear(4, 3).to(DT)
        self.scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        u = self.p(self.fc0(x))
        weakref.finalize(u, _write, self, u.detach())
        return self.fc1(torch.tanh(u * self.scale))


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_an_attribute_written_when_the_last_chunk_is_released_is_refused(engine):
    x, y = outlier_batch()
    model = _AttributeAfterTheStep()
    ctx = StepContext.at(0, steps_per_epoch=10, total_steps=10, expected_batch_size=8.0,
                         base_noise_multiplier=0.0)
    with pytest.raises(UnsupportedModelError, match="Python attribute 'scale'"):
        dp_step(model, x, y, loss_fn=ce, strategy=FixedClip(C), state={}, engine=engine(),
                groups=ParamGroups.flat(model), sampler=PoissonSampler(100, 8.0),
                base_noise_multiplier=0.0, ctx=ctx, generator=make_generator(0))
    assert model.scale == 1.0  # put back


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_buffer_written_when_the_last_chunk_is_released_is_refused(engine):
    x, y = outlier_batch()
    model = _CarriesBetweenChunks()
    with pytest.raises(UnsupportedModelError, match="written after the step's reads"):
        engine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
