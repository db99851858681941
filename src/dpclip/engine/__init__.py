"""Engines: how per-example norms and the weighted gradient sum ``sum_i w_i g_i`` are computed.

``vmap``   - ``torch.func`` reference engine (per-example, flat or per-group norms);
``ghost``  - ghost norms and book-keeping from one backward (Linear, Conv1d/2d, Embedding,
             LayerNorm, RMSNorm, GroupNorm, eval-mode BatchNorm); other layers raise
             ``UnsupportedModelError`` unless built with ``fallback="vmap"``;
``auto``   - ``ghost`` when the model is supported and proven separable, else ``vmap`` (recorded in
             ``engine_info``), decided once per model on a public probe batch before the model
             sees private data; on the compiled path where the proof's graph is proved
             (``engine_info["program"] == "compiled"``; ``AutoEngine(compiled=False)``: the
             traced path only); the default of ``dpclip train`` and ``make_private``;
``compiled`` - ``ghost`` on the batch-size proof's graph, proved once and run instead of the
             model's code on every step, refusing the models it cannot prove
             (:mod:`dpclip.engine.compiled`);
``naive``  - explicit per-example loop (the test oracle; slow);
``summed`` - plain batched backward of the summed loss (no norms; bound-based strategies, batch
             clipping).

Get one by name with :func:`get_engine` (the CLI/config boundary); unknown names fail with the list
of valid names.
"""

from __future__ import annotations

from typing import Any

from dpclip.engine.base import Engine, EngineResult, LossFn, ParamGroups, WeightFn
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.ghost import AutoEngine, CompiledEngine, GhostEngine, ghost_support
from dpclip.engine.naive import NaiveEngine, naive_per_example_grads
from dpclip.engine.summed import SummedEngine
from dpclip.engine.vmap import VmapEngine, vmap_per_example_grads
from dpclip.registry import Registry

__all__ = [
    "ENGINES",
    "AutoEngine",
    "CompiledEngine",
    "Engine",
    "EngineResult",
    "GhostEngine",
    "LossFn",
    "NaiveEngine",
    "ParamGroups",
    "SummedEngine",
    "UnsupportedModelError",
    "VmapEngine",
    "WeightFn",
    "get_engine",
    "ghost_support",
    "naive_per_example_grads",
    "vmap_per_example_grads",
]

#: Registered engines by name (read-only).
ENGINES: Registry[type[Any]] = Registry("engine")
for _cls in (VmapEngine, GhostEngine, AutoEngine, CompiledEngine, NaiveEngine, SummedEngine):
    ENGINES.register(_cls)
del _cls


def get_engine(name: str, **kwargs: Any) -> Engine:
    """Instantiate the engine registered as ``name`` with ``kwargs`` (e.g. ``max_physical_batch``;
    ``norm_mode`` and ``fallback`` for ``ghost``).

    Raises ``ValueError`` naming the valid engines for an unknown name.
    """
    return ENGINES.lookup(name)(**kwargs)
