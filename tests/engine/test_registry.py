"""The engine registry and the package's public names."""

from __future__ import annotations

import pytest

import dpclip.engine as engine_pkg
from dpclip.engine import (
    ENGINES,
    AutoEngine,
    CompiledEngine,
    GhostEngine,
    NaiveEngine,
    SummedEngine,
    VmapEngine,
    get_engine,
)


def test_registry_entries():
    assert dict(ENGINES) == {"vmap": VmapEngine, "naive": NaiveEngine, "summed": SummedEngine,
                             "ghost": GhostEngine, "auto": AutoEngine,
                             "compiled": CompiledEngine}
    for name, cls in ENGINES.items():
        assert cls.name == name
    assert VmapEngine.per_example and NaiveEngine.per_example and not SummedEngine.per_example
    assert GhostEngine.per_example and AutoEngine.per_example and CompiledEngine.per_example
    with pytest.raises(TypeError):
        ENGINES["other"] = VmapEngine  # read-only


def test_get_engine_builds_with_options():
    e = get_engine("vmap", max_physical_batch=3)
    assert isinstance(e, VmapEngine) and e.max_physical_batch == 3
    assert get_engine("vmap").max_physical_batch == 256
    assert isinstance(get_engine("naive", max_physical_batch=5), NaiveEngine)
    assert isinstance(get_engine("summed"), SummedEngine)


@pytest.mark.parametrize("bad", ["ghots", "", "VMAP"])
def test_unknown_engine_lists_valid_names(bad):
    with pytest.raises(ValueError, match="unknown engine") as info:
        get_engine(bad)
    msg = str(info.value)
    assert repr(bad) in msg
    for name in ("auto", "compiled", "ghost", "naive", "summed", "vmap"):
        assert name in msg


def test_curated_all():
    assert sorted(engine_pkg.__all__) == sorted([
        "ENGINES", "AutoEngine", "CompiledEngine", "Engine", "EngineResult", "GhostEngine", "ghost_support", "LossFn", "NaiveEngine", "ParamGroups",
        "SummedEngine", "UnsupportedModelError", "VmapEngine", "WeightFn", "get_engine",
        "naive_per_example_grads", "vmap_per_example_grads",
    ])
    for name in engine_pkg.__all__:
        assert hasattr(engine_pkg, name), name
