"""``auto`` (``GhostEngine(fallback="vmap")``) decides its engine once per model on a PUBLIC probe
batch, before the model sees private data (issue 31, docs/engines.md "The engine is decided before
the model sees private data"). The attacks it closes are in ``test_hostile_review4.py``
(``auto-fallback-*``); here: the contract (once per model, the verdict recorded, the generators
untouched, no private value reaches the model before the verdict) and error 106."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine.batch import padded_rows
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT
from tests.engine.test_hostile_review import _SW, third_review_cleanup
from tests.engine.test_hostile_review4 import _KeepsThenMixes, _STASH, _keep_numpy, _read_numpy
from tests.engine.test_separability_attacks import ce, clipped_sum, data


class _Centred(nn.Module):
    """Mixes the examples (``h - h.mean(0)``): ghost refuses it at run time, every batch."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.drop = nn.Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        return self.fc2(self.drop(torch.tanh(h - h.mean(0))))


class _Honest(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.drop = nn.Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


#: the batches each ``_Seen`` model got, by model id (outside the model: a list attribute
#: changed in the call is refused, dpclip.engine.isolation)
_SEEN: dict[int, list[Tensor]] = {}


class _Seen(nn.Module):
    """Keeps every real batch its forward gets (not under vmap, not the proof's fake tensors):
    a reference, no operation (a copy would be an escape the tracer refuses)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        _SEEN[id(self)] = []

    @property
    def seen(self) -> list[Tensor]:
        return _SEEN[id(self)]

    def forward(self, x: Tensor) -> Tensor:
        if not torch._C._functorch.is_functorch_wrapped_tensor(x) and not is_fake(x):
            _SEEN[id(self)].append(x)
        return self.inner(x)


def _count_probes(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = GhostEngine._probe

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GhostEngine, "_probe", counted)
    return calls


@pytest.mark.parametrize("build, engine", [(_Honest, "ghost"), (_Centred, "vmap")])
def test_the_engine_is_decided_once_per_model_and_recorded(build, engine, monkeypatch):
    """One probe per model (auto and GhostEngine(fallback='vmap') share it); every step records
    the engine that ran and, on vmap, the probe's reason; the result equals vmap's."""
    calls = _count_probes(monkeypatch)
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = data()
    ref, _ = clipped_sum(VmapEngine(), model, ce, x, y)
    for eng in (AutoEngine(), AutoEngine(), GhostEngine(fallback="vmap")):
        got, info = clipped_sum(eng, model, ce, x, y)
        assert info["engine"] == engine and info["requested"] == eng.name
        assert bool(info["fallback"]) == (engine == "vmap")
        if engine == "vmap":
            assert "h.mean(0)" in info["fallback"] or "mean" in info["fallback"]
        assert torch.allclose(got, ref, rtol=1e-9, atol=1e-12)
    assert len(calls) == 1


@pytest.mark.parametrize("build", [_Honest, _Centred])
def test_no_private_value_reaches_the_model_before_the_verdict(build):
    """The model's first plain-tensor call is the probe: zeros, two rows, whatever the private
    batch; on a vmap verdict it is the only one (vmap evaluates each example alone)."""
    torch.manual_seed(0)
    model = _Seen(build()).to(DT)
    x, y = data(b=7)
    for _ in range(2):
        clipped_sum(AutoEngine(), model, ce, x, y)
    first = model.seen[0]
    # (two rows, padded to the engines' row block: dpclip.engine.batch.padded_rows)
    assert first.shape == (padded_rows(2), 5) and not first.any()
    if build is _Centred:
        assert len(model.seen) == 1
    else:
        assert any(s.shape == (padded_rows(7), 5) and torch.equal(s[:7], x)
                   for s in model.seen[1:])


@pytest.mark.parametrize("build", [_Honest, _Centred])
def test_the_probe_leaves_the_generators_as_it_found_them(build):
    """Dropout masks of a step under auto are those of the engine it chose, run from the same
    seed without a probe (the probe's draws are undone)."""
    x, y = data()
    torch.manual_seed(0)
    model = build(0.5).to(DT)
    ref_engine = GhostEngine() if build is _Honest else VmapEngine(max_physical_batch=256)
    torch.manual_seed(5)
    want, _ = clipped_sum(ref_engine, model, ce, x, y)
    after_want = torch.rand(3)
    torch.manual_seed(0)
    model = build(0.5).to(DT)
    torch.manual_seed(5)
    got, info = clipped_sum(AutoEngine(), model, ce, x, y)
    assert info["engine"] == ("ghost" if build is _Honest else "vmap")
    assert torch.equal(got, want)
    assert torch.equal(torch.rand(3), after_want)


class _NeedsPositiveIds(nn.Module):
    """Honest, but its ids start at 1: the probe's zeros index row -1 and fail."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(6, 4), nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.emb(ids - 1).mean(1))


def test_a_model_that_cannot_take_the_probe_runs_on_vmap_recorded():
    torch.manual_seed(0)
    model = _NeedsPositiveIds().to(DT)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(1, 7, (6, 4), generator=g), torch.randint(0, 3, (6,), generator=g)
    got, info = clipped_sum(AutoEngine(), model, ce, x, y)
    assert info["engine"] == "vmap"
    assert "could not run the public probe batch" in info["fallback"]
    want, _ = clipped_sum(VmapEngine(), model, ce, x, y)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


def test_error_106_a_private_refusal_after_the_probe_stops_the_run():
    """docs/errors.md entry 106: a private step refused at run time after the probe chose ghost
    stops (never a vmap fallback: the ghost forward has run the model on the private batch).
    On the traced path (``compiled=False``): auto's compiled path runs the proved graph, not the
    model's switched code (tests/engine/test_auto_compiled.py)."""
    torch.manual_seed(0)
    model = _KeepsThenMixes(_keep_numpy, _read_numpy).to(DT)
    x, y = data()
    try:
        _, info = clipped_sum(AutoEngine(compiled=False), model, ce, x, y)
        assert info["engine"] == "ghost"
        _SW["on"] = True
        with pytest.raises(UnsupportedModelError, match=r"auto engine: the ghost engine refused "
                           r"a private step at run time \(.*\), after the public probe batch "
                           r"had chosen it for this model\. This is not turned into a vmap "
                           r"fallback"):
            clipped_sum(AutoEngine(compiled=False), model, ce, x, y)
    finally:
        third_review_cleanup()
        _STASH.clear()


_HASHES = itertools.count(1)


class _ShiftyIdentity(_KeepsThenMixes):
    """The switched attack whose ``__hash__`` / ``__eq__`` change on every call: a verdict kept by
    hash would be looked up in vain, and a new probe (with the switch on: refused, so vmap)
    would come after private steps on ghost."""

    def __hash__(self) -> int:  # (a counter outside the class: a class attribute changed in
        return next(_HASHES)     # the step is refused, dpclip.engine.isolation)

    def __eq__(self, other) -> bool:
        return False


def test_the_verdict_is_kept_by_identity_not_by_hash(monkeypatch):
    calls = _count_probes(monkeypatch)
    torch.manual_seed(0)
    model = _ShiftyIdentity(_keep_numpy, _read_numpy).to(DT)
    x, y = data()
    try:
        for _ in range(2):
            _, info = clipped_sum(AutoEngine(), model, ce, x, y)
            assert info["engine"] == "ghost"
        _SW["on"] = True
        with pytest.raises(UnsupportedModelError, match="refused a private step at run time"):
            clipped_sum(AutoEngine(compiled=False), model, ce, x, y)
    finally:
        third_review_cleanup()
        _STASH.clear()
    assert len(calls) == 1


def test_the_verdict_is_dropped_with_its_model():
    import gc

    from dpclip.engine import ghost

    torch.manual_seed(0)
    model = _Honest().to(DT)
    x, y = data()
    clipped_sum(AutoEngine(), model, ce, x, y)
    from dpclip._ident import ident

    key = ident(model)
    assert ghost._verdict_of(model) is not None
    del model
    gc.collect()
    assert key not in ghost._VERDICTS


def test_the_verdict_does_not_depend_on_the_private_batch():
    """The same model met first with batches of different sizes and values gets the same
    verdict and the same recorded reason (the probe is two zero examples either way)."""
    got = set()
    for b, seed in ((3, 0), (9, 1), (0, 2)):
        torch.manual_seed(0)
        model = _Centred().to(DT)
        x, y = data(b=b, seed=seed)
        _, info = clipped_sum(AutoEngine(), model, ce, x, y)
        got.add((info["engine"], info["fallback"]))
    assert len(got) == 1 and next(iter(got))[0] == "vmap"


def test_a_fresh_k_copy_view_every_step_gets_no_fresh_probe(monkeypatch):
    """Augmentation multiplicity builds a new ``KCopyModel`` view of the model for every step.
    Keyed by the view, each step would probe again AFTER the model had run on private data under
    ghost: a model that stashes a private batch, then turns a later probe into a vmap verdict
    (say, by mixing when it sees zeros), would have vmap read the stash. The verdict belongs to
    the viewed model (``register_view``): one probe for the run, ghost on every step."""
    from dpclip.training.multiplicity import KCopyModel, expand_copies, k_copy_loss

    calls = _count_probes(monkeypatch)
    torch.manual_seed(0)
    model = _Honest().to(DT)
    x, y = data()
    loss = k_copy_loss(ce, 2)
    for step in range(3):
        xs = expand_copies(x + step, 2)
        _, info = clipped_sum(AutoEngine(), KCopyModel(model, 2), loss, xs, y)
        assert info["engine"] == "ghost" and not info["fallback"]
    assert len(calls) == 1
