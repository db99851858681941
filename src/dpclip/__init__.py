"""dpclip: differentially private training with every gradient-clipping strategy of the literature.

The public API (see README.md): ``make_private`` wraps your own model, optimizer and data for your
own loop; ``train`` / ``TrainConfig`` run a private training job from the registries (through the
same loop); ``dp_step`` is one step; strategies live in ``dpclip.clipping``, engines in ``dpclip.engine``, accounting in
``dpclip.accounting``, samplers in ``dpclip.training.sampling``.
"""

__version__ = "0.2.0"

# first: MKL's alignment-independent mode must be set before its first call (dpclip.blas_mode)
from dpclip import blas_mode as _blas_mode

_blas_mode.ensure()

from dpclip.accounting import Ledger, calibrate_noise_multiplier, compute_epsilon, epsilon
from dpclip.clipping import FixedClip, StepContext, list_strategies, make_strategy
# dpclip.lipschitz (a room above clipping and models) registers the bound-based strategies and the
# Lipschitz models; importing dpclip (which any import of a submodule does first) registers them
from dpclip import lipschitz as _lipschitz  # noqa: F401
from dpclip.engine import ParamGroups, get_engine
from dpclip.events import (
    ComposedEvent,
    GaussianEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
)
from dpclip.model_check import ModelReport, check_model, fix_model
from dpclip.training.private import BudgetExhausted, PrivateTraining, make_private
from dpclip.randomness import PrivateRandomness
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler
from dpclip.training.step import dp_step
from dpclip.training.trainer import RunResult, TrainConfig, train

__all__ = [
    "BudgetExhausted",
    "ComposedEvent",
    "FixedClip",
    "FixedSizeSampler",
    "GaussianEvent",
    "Ledger",
    "ModelReport",
    "ParamGroups",
    "PoissonSampledEvent",
    "PoissonSampler",
    "PrivateRandomness",
    "PrivateTraining",
    "RunResult",
    "SampledWithoutReplacementEvent",
    "SelfComposedEvent",
    "StepContext",
    "TrainConfig",
    "__version__",
    "calibrate_noise_multiplier",
    "check_model",
    "compute_epsilon",
    "dp_step",
    "epsilon",
    "fix_model",
    "get_engine",
    "list_strategies",
    "make_private",
    "make_strategy",
    "train",
]
