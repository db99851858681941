"""``engine="auto"`` on the compiled path (``AutoEngine(compiled=True)``, the default): where the
batch-size proof's graph is proved, the first private step runs traced (and adopts the graph), later
steps run the graph; anything the compiled path refuses runs on the traced path instead of stopping
the run; the public probe adopts nothing. Oracles: the float64 per-example loop, the explicit
compiled engine, and the switched attacks of the traced path's suites, whose Python the graph never
runs (refused, or the release of the honest program)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, CompiledEngine, ParamGroups, get_engine
from dpclip.engine import compiled as compiled_mod
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT, clip_weights
from tests.engine.test_compiled_engine import (
    Block, C, _equal_to_the_loop, _seq, graph_runs)
from tests.engine.test_hostile_review import (
    _RewriteKeptInput, _RewriteWeightForTheCall, _SW, third_review_cleanup)
from tests.engine.test_hostile_review4 import (
    FOURTH, _KEEP, _KeepsThenMixes, _STASH, _keep_numpy, _read_numpy)
from tests.engine.test_separability_attacks import ce, data, loo_distance


def _step(engine, model, loss, x, y, groups=None):
    return engine.compute(model, loss, x, y, clip_weights(C),
                          groups or ParamGroups.flat(model))


@pytest.mark.parametrize("groups", ["flat", "per_layer"])
def test_auto_releases_the_graph_s_sum_from_the_first_private_step(groups):
    """The probe (public zeros) runs traced; the first private step runs traced for its checks
    and is released from the graph, adopted then (session 24): every private step's sum comes
    from the graph."""
    model = Block().to(DT)
    x, y = _seq()
    g = getattr(ParamGroups, groups)(model)
    compiled_mod.reset(model)
    programs = []
    for _ in range(3):
        with graph_runs() as ran:
            res = _step(AutoEngine(), model, ce, x, y, g)
        _equal_to_the_loop(res, model, ce, x, y, g)
        programs.append((res.engine_info.get("program"), ran[0]))
    assert programs == [("compiled", 1), ("compiled", 1), ("compiled", 1)]
    assert res.engine_info["engine"] == "ghost" and res.engine_info["requested"] == "auto"


def _hooked(m):
    m.ff.register_forward_hook(lambda mod, i, o: o * 10)


def _pre_hooked(m):
    m.out.register_forward_pre_hook(lambda mod, i: (i[0] * 10,))


def _forward_swapped(m):
    m.forward = lambda x: Block.forward(m, x) * 10


def _adopted():
    """A Block, its batch and an auto engine whose graph was adopted (two steps)."""
    model = Block().to(DT)
    x, y = _seq()
    compiled_mod.reset(model)
    eng = AutoEngine()
    for _ in range(2):
        _step(eng, model, ce, x, y)
    return model, x, y, eng


@pytest.mark.parametrize("change", [_pre_hooked, _forward_swapped],
                         ids=["pre-hook", "instance-forward"])
def test_hooks_or_a_forward_set_after_adoption_run(change):
    """Seventy-seventh hostile review: a hook registered, or the instance's forward replaced,
    after the graph was adopted never ran: the compiled steps trained the captured program (0.36
    to 0.76 off the loop). They are part of the proof's key now: the step gets a proof and a graph
    of its own, equal to the loop of the model as it is."""
    model, x, y, eng = _adopted()
    change(model)
    progs = []
    for _ in range(2):
        with graph_runs() as ran:
            res = _step(eng, model, ce, x, y)
        _equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))
        progs.append(ran[0])
    # (the new program's first step: traced for its checks, then released from its own graph)
    assert progs == [1, 1]


def test_a_forward_hook_on_a_layer_set_after_adoption_stops_the_run():
    """The same review's forward hook (the output of a ruled layer scaled): the compiled steps
    ignored it; now the step is traced, which refuses a hook on a ruled layer's output, as on the
    first step."""
    model, x, y, eng = _adopted()
    _hooked(model)
    with graph_runs() as ran, pytest.raises(UnsupportedModelError, match="forward hook"):
        _step(eng, model, ce, x, y)
    assert ran[0] == 0


def test_compiled_false_keeps_the_traced_path():
    model = Block().to(DT)
    x, y = _seq()
    compiled_mod.reset(model)
    for _ in range(3):
        with graph_runs() as ran:
            res = _step(AutoEngine(compiled=False), model, ce, x, y)
        assert ran[0] == 0 and "program" not in res.engine_info
        _equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))
    with pytest.raises(ValueError, match="AutoEngine: compiled must be True or False"):
        AutoEngine(compiled="yes")
    assert get_engine("auto", compiled=False) == AutoEngine(compiled=False)


class InPlace(nn.Module):
    """An in-place write through a view whose base is read afterwards: the compiled path refuses
    the graph (it runs writes out of place only where no alias sees them), the traced path runs
    it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h[:, :4].mul_(2.0)
        return self.fc2(torch.tanh(h))


def test_a_graph_the_compiled_path_refuses_runs_traced():
    torch.manual_seed(0)
    model = InPlace().to(DT)
    x, y = data()
    with pytest.raises(UnsupportedModelError, match="compiled engine"):
        for _ in range(2):
            _step(CompiledEngine(), model, ce, x, y)
    for _ in range(3):
        with graph_runs() as ran:
            res = _step(AutoEngine(), model, ce, x, y)
        assert ran[0] == 0 and "program" not in res.engine_info
        assert res.engine_info["engine"] == "ghost"
        _equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))


def test_a_step_whose_checks_refuse_the_graph_runs_traced():
    """A layer reconfigured after the graph was adopted: the compiled engine refuses the step;
    auto proves the new program, runs the step traced for its checks and releases it from the new
    graph."""
    model = Block().to(DT)
    x, y = _seq()
    compiled_mod.reset(model)
    for _ in range(2):
        _step(AutoEngine(), model, ce, x, y)
    model.norm1.eps = 1e-3  # (a plain attribute: a new key, a new proof and graph)
    for _ in range(2):
        with graph_runs() as ran:
            res = _step(AutoEngine(), model, ce, x, y)
        assert ran[0] == 1 and res.engine_info["program"] == "compiled"
        _equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))
    _equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))


def test_auto_equals_the_compiled_engine():
    model = Block().to(DT)
    x, y = _seq(b=7, seed=4)
    compiled_mod.reset(model)
    got = [[_step(e, model, ce, x, y) for _ in range(3)][-1]
           for e in (AutoEngine(), CompiledEngine())]
    torch.testing.assert_close(got[0].norms, got[1].norms, rtol=0, atol=0)
    for n in got[0].grads:
        torch.testing.assert_close(got[0].grads[n], got[1].grads[n], rtol=0, atol=0)


#: switched attacks whose refusal on the traced path is an errors.md entry (tests/engine/
#: test_auto_probe.py, test_hostile_review.py, test_hostile_review4.py)
SWITCHED = {
    "keeps-then-mixes (106)": (lambda: _KeepsThenMixes(_keep_numpy, _read_numpy), ce),
    "kept-input-rewritten (97)": (_RewriteKeptInput, ce),
    "weight-written-for-the-call (98)": (_RewriteWeightForTheCall, ce),
    **{f"{k} (99/101)": FOURTH[k] for k in (
        "node-prehook-torch-function-off", "backward-hooks-descriptor",
        "intermediate-rewritten-before-use", "known-chain-saved-output-rewritten-after-use")},
}


@pytest.mark.parametrize("name", list(SWITCHED))
def test_switched_attacks_on_the_graph_are_refused_or_release_the_honest_program(name):
    """The attack's Python runs on the traced steps only: switched on after the graph was
    adopted, it is refused (the graph was not adopted) or the step releases exactly what the
    honest program releases, and every leave-one-out distance is at most C."""
    build, loss = SWITCHED[name]
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = data()
    compiled_mod.reset(model)
    try:
        _SW["on"] = False
        honest = [_step(AutoEngine(), model, loss, x, y) for _ in range(3)][-1]
        _SW["on"] = True
        try:
            got = _step(AutoEngine(), model, loss, x, y)
        except UnsupportedModelError:
            assert honest.engine_info.get("program") != "compiled"
            return
        assert got.engine_info.get("program") == "compiled"
        for n in honest.grads:
            torch.testing.assert_close(got.grads[n], honest.grads[n], rtol=0, atol=0)
        assert loo_distance(AutoEngine(), model, loss, x, y) <= 1 + 1e-9
    finally:
        _SW["on"] = False
        third_review_cleanup()
        _KEEP.clear()
        _STASH.clear()


def test_make_private_on_auto_counts_the_graph_steps():
    """The default engine: Poisson batches of varying size, one graph after the first step;
    ``compiled_steps`` counts the steps that ran it (NON-PRIVATE: not in the summary)."""
    import dpclip

    model = Block().to(DT)
    compiled_mod.reset(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(96, 5, 3, generator=g, dtype=DT), torch.randint(0, 3, (96,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = dpclip.make_private(model, opt, (x, y), noise_multiplier=1.0, delta=1e-5, steps=4,
                             batch_size=16, verbose=False)
    with graph_runs() as ran:
        for xb, yb in dp.loader:
            dp.backward(xb, yb)
            opt.step()
            opt.zero_grad()
    d = dp.describe()
    assert d["engine"] == "ghost" and d["engine_requested"] == "auto"
    # the count is NON-PRIVATE (the non-empty batches less one): kept, never in describe()
    assert dp.compiled_steps == ran[0] >= 3
    assert "engine_compiled_steps" not in d and ran[0] not in (
        v for v in d.values() if type(v) is int and v not in (d["steps"], d["planned_steps"]))


def test_the_compiled_step_count_never_reaches_the_summary():
    """Seventy-seventh hostile review: describe() published the compiled steps, the non-empty
    batches less one (an empty batch runs no program, the first non-empty one adopts the graph):
    on a dataset of 3 records at sample rate 0.4 it told D from D' without one record at noise
    multiplier 50. Two runs of 30 steps, one whose batches are all non-empty and one with empty
    batches: the count differs, and neither summary has a key for it."""
    import dpclip

    def run(n, rate_batch):
        torch.manual_seed(0)
        model = Block().to(DT)
        compiled_mod.reset(model)
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(n, 5, 3, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dp = dpclip.make_private(model, opt, (x, y), noise_multiplier=50.0, delta=1e-5, steps=30,
                                 batch_size=rate_batch, verbose=False)
        empty = 0
        while dp.steps < 30:
            for xb, yb in dp.loader:
                empty += int(len(yb) == 0)
                dp.backward(xb, yb)
                opt.step()
                opt.zero_grad()
                if dp.steps == 30:
                    break
        return dp, empty

    full, e_full = run(48, 16)
    sparse, e_sparse = run(2, 0.6)  # (no empty batch in 30 steps: probability 0.51**30)
    assert e_full == 0 and e_sparse >= 1  # (the second run had empty batches)
    assert sparse.compiled_steps < full.compiled_steps  # (what the summary used to publish)
    for d in (full.describe(), sparse.describe()):
        assert not any("compiled" in k for k in d)


def test_a_graph_that_fails_when_it_runs_leaves_auto_on_the_traced_path():
    """A kernel the analysis never ran (another device's) failing in a graph step: auto runs that
    step and the next ones traced, equal to the loop; the compiled engine raises."""
    model = Block().to(DT)
    x, y = _seq()
    compiled_mod.reset(model)
    for _ in range(2):
        _step(AutoEngine(), model, ce, x, y)
    plans = [p for p in compiled_mod._PLANS.values() if not isinstance(p, str)]
    assert plans and all(p.confirmed for p in plans)

    def boom(*args):
        raise RuntimeError("no kernel for this device")

    real = [p.fn for p in plans]
    for p in plans:
        p.fn = boom
    try:
        for _ in range(2):
            with graph_runs() as ran:
                res = _step(AutoEngine(), model, ce, x, y)
            assert "program" not in res.engine_info
            _equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))
        assert ran[0] == 0  # (not tried again)
        assert all(p.failed and "no kernel for this device" in p.failed for p in plans)
        for p in plans:
            p.failed = None
        with pytest.raises(RuntimeError, match="no kernel for this device"):
            _step(CompiledEngine(), model, ce, x, y)
    finally:
        for p, f in zip(plans, real):
            p.fn, p.failed = f, None


class Cast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.norm(torch.tanh(self.fc1(x * 1.0))))


def _ce32(out: Tensor, y: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(out.float(), y, reduction="none")


@pytest.mark.parametrize("engine", ["auto", "ghost"])
def test_autocast_switched_on_between_steps_gets_a_proof_of_its_own(engine):
    """Autocast is part of the proof's key: a step that switches it on is proved under it (traced:
    the compiled path is not analysed under autocast) instead of refused as another program
    (seventy-fifth hostile review), and switching it off again finds the first proof (and on auto
    its graph). Under autocast the leave-one-out distance stays within C."""
    from dpclip.engine import GhostEngine
    from tests.engine.test_separability_attacks import data

    make = {"auto": AutoEngine, "ghost": GhostEngine}[engine]
    model = Cast()
    compiled_mod.reset(model)
    x, y = data()
    x = x.float()
    programs = []
    for on in (False, False, True, True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            res = make().compute(model, _ce32, x, y, clip_weights(C), ParamGroups.flat(model))
        programs.append(res.engine_info.get("program"))
    # (auto: the graph's sum from its first step; under autocast the traced path, not analysed)
    want = ["compiled", "compiled", None, None, "compiled"] if engine == "auto" else [None] * 5
    assert programs == want


    def release(rows):  # (one autocast region per step, as a training loop enters it: autocast's
        # cast cache, kept for the region, would make a second step run another program)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res = make().compute(model, _ce32, x[rows], y[rows], clip_weights(C),
                                 ParamGroups.flat(model))
        return torch.cat([g.reshape(-1) for g in res.grads.values()]).double()

    b = x.shape[0]
    full = release(list(range(b)))
    worst = max(float((full - release([i for i in range(b) if i != j])).norm())
                for j in range(b))
    assert worst <= C * (1 + 1e-6)
