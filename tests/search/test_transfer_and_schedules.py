"""Transfer strategy, stored schedules (store, list, reuse), C0 of lin-decay from greedy."""

import dataclasses
import json
import warnings

import pytest

from dpclip.clipping import STRATEGIES, StepContext, make_strategy
from dpclip.clipping.fixed import FixedClip
from dpclip.clipping.schedules import LinDecay, Transfer
from dpclip.data import PUBLIC_PROXIES, public_proxy
from dpclip.store import ResultsStore
from dpclip.search import GreedyConfig, greedy_c0, resolve_strategy_params, run_or_reuse
from dpclip.training.trainer import TrainConfig


def ctx(epoch, spe=5):
    return StepContext(step=epoch * spe, epoch=epoch, steps_per_epoch=spe, total_steps=100,
                       expected_batch_size=16.0, base_noise_multiplier=1.0)


def test_transfer_thresholds_per_epoch_and_sensitivity():
    s = make_strategy("transfer", {"thresholds": "0.3, 0.2, 0.1", "schedule": "lin"})
    assert isinstance(s, Transfer) and s.inner == FixedClip(0.3)
    state = s.init_state()
    assert s.sensitivity(state) == 0.3
    seen = []
    for e in range(5):
        state = s.begin_step(state, ctx(e))
        seen.append(s.sensitivity(state))
        assert state["epoch"] == e + 1
    assert seen == [0.3, 0.2, 0.1, 0.1, 0.1]  # past the end: the last value
    assert s.planned_event(1.3, ctx(4)) == FixedClip(0.1).planned_event(1.3, ctx(4))
    d = s.describe()
    assert d["thresholds"] == [0.3, 0.2, 0.1] and d["schedule"] == "lin"
    assert json.loads(json.dumps(d)) == d and make_strategy("transfer", d) == s
    wrapped = make_strategy("transfer", {"base": "auto-s", "thresholds": [0.5, 0.25]})
    assert wrapped.inner.clip_norm == 0.5


@pytest.mark.parametrize("params, match", [
    ({}, "needs thresholds"),
    ({"schedule": "x"}, "resolved into thresholds by `dpclip train`/`dpclip run`"),
    ({"thresholds": []}, "non-empty list"),
    ({"thresholds": [0.2, -1]}, r"thresholds\[1\] must be"),
    ({"thresholds": [0.2], "clip_norm": 0.5}, "conflicts with thresholds"),
])
def test_transfer_errors(params, match):
    with pytest.raises(ValueError, match=match):
        make_strategy("transfer", params)


def test_transfer_is_in_the_contract_suites():
    """tests/clipping/test_contract.py and tests/core/test_neighbours.py iterate the registry."""
    e = STRATEGIES["transfer"]
    assert e.kind == "norm" and e.cls.contract_params["thresholds"]
    from tests.clipping.contract import ALL_CHECKS, contract_strategy

    for check in ALL_CHECKS:
        check(contract_strategy("transfer"))


def test_lin_decay_refuses_unresolved_greedy_c0():
    with pytest.raises(ValueError, match="resolved by `dpclip train`"):
        make_strategy("lin-decay", {"c0_from": "greedy"})
    s = make_strategy("lin-decay", {"clip_norm": 0.4, "c0_from": "greedy:mnist-5k:5 runs:x"})
    assert s.describe()["c0_from"].startswith("greedy:") and s.initial_clip_norm == 0.4
    assert make_strategy("lin-decay", {"a": 0.25}) == LinDecay(FixedClip(1.0), 0.25)


def test_public_proxy_pairs():
    assert public_proxy("fashion-mnist") == "mnist-5k"
    assert public_proxy("fashion-mnist", "digits") == "digits"
    assert public_proxy("mnist") == "fashion-mnist"
    assert public_proxy("cifar10") == "cifar100"
    with pytest.raises(ValueError, match="no public proxy is known for dataset 'synthetic'"):
        public_proxy("synthetic")
    with pytest.raises(ValueError, match="not a known public proxy"):
        public_proxy("fashion-mnist", "synthetic")


def small(**kw):
    base = dict(dataset="digits", model="logreg", noise_multiplier=0.8, batch_size=256,
                lr=0.5, epochs=2, c_start=0.5, step=0.5, tolerance=0.05)
    base.update(kw)
    return GreedyConfig(**base)


def test_schedules_stored_listed_and_reused(tmp_path, monkeypatch):
    with ResultsStore(tmp_path / "r.db") as store:
        name, th, meta = run_or_reuse(small(), store, checkpoint_root=tmp_path / "ck",
                                      progress=False)
        assert name.startswith("greedy-digits-logreg-z0.8-b256-lr0.5-e2-s0-")
        assert len(th) == 2 and meta["dataset"] == "digits" and meta["privacy"] == "public"
        assert meta["noise_multiplier"] == 0.8 and meta["seed"] == 0 and meta["candidates"]
        listed = store.schedules()
        assert [r["name"] for r in listed] == [name] and listed[0]["thresholds"] == th

        import dpclip.search.resolve as resolve

        def boom(*a, **k):
            raise AssertionError("the stored schedule must be reused")

        monkeypatch.setattr(resolve, "greedy_search", boom)
        assert run_or_reuse(small(), store, progress=False)[1] == th
        with pytest.raises(ValueError, match="different schedule named"):
            run_or_reuse(small(seed=3), store, name=name, progress=False)

        # transfer reuses it by name; the run's params record the name and the thresholds
        cfg = TrainConfig(dataset="synthetic", model="logreg", strategy="transfer",
                          strategy_params={"schedule": name}, noise_multiplier=0.8,
                          batch_size=256, lr=0.5, epochs=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # same model, B, lr, sigma, epochs: no warning
            resolved = resolve_strategy_params(cfg, store)
        assert resolved.strategy_params == {"schedule": name, "thresholds": th}
        s = make_strategy("transfer", resolved.strategy_params)
        assert s.describe()["schedule"] == name and list(s.thresholds) == th
        with pytest.warns(UserWarning, match=r"lr 0.5 \(schedule\) vs 1.0 \(run\).*the run 4"):
            resolve_strategy_params(dataclasses.replace(cfg, lr=1.0, epochs=4), store)


def test_nonprivate_schedule_is_refused_for_transfer(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        store.save_schedule("np", [0.3], {"dataset": "synthetic", "privacy": "NON-PRIVATE",
                                          "nonprivate": True})
        cfg = TrainConfig(dataset="synthetic", model="logreg", strategy="transfer",
                          strategy_params={"schedule": "np"}, noise_multiplier=1.0)
        with pytest.raises(ValueError, match="not differentially private"):
            resolve_strategy_params(cfg, store)
        with pytest.raises(ValueError, match="no threshold schedule named 'nope'"):
            resolve_strategy_params(
                TrainConfig(strategy="transfer", strategy_params={"schedule": "nope"},
                            noise_multiplier=1.0), store)


def test_lin_decay_c0_is_the_mean_of_first_epoch_greedy_runs(tmp_path, monkeypatch):
    monkeypatch.setitem(PUBLIC_PROXIES, "synthetic", ("digits",))
    cfg = TrainConfig(dataset="synthetic", model="logreg", strategy="lin-decay",
                      strategy_params={"c0_from": "greedy", "c0_runs": 3, "c0_c_start": 0.25,
                                       "c0_step": 0.5, "c0_tolerance": 0.05},
                      noise_multiplier=0.8, batch_size=128, lr=0.5, epochs=3)
    with ResultsStore(tmp_path / "r.db") as store:
        resolved = resolve_strategy_params(cfg, store, checkpoint_root=tmp_path / "ck",
                                           progress=False)
        scheds = store.schedules()
        assert len(scheds) == 3 and {s["metadata"]["seed"] for s in scheds} == {0, 1, 2}
        for s in scheds:
            m = s["metadata"]
            assert m["epochs"] == 1 and m["dataset"] == "digits" and m["proxy_for"] == "synthetic"
            assert m["steps_per_epoch"] == 4  # one epoch of the PRIVATE run: 512 / 128
            assert m["c_start"] == 0.25 and m["noise_multiplier"] == 0.8
        firsts = [s["thresholds"][0] for s in scheds]
        p = resolved.strategy_params
        assert p["clip_norm"] == pytest.approx(sum(firsts) / 3)
        assert p["c0_from"].startswith("greedy:digits:3 runs:greedy-digits-logreg")
        assert not any(k.startswith("c0_") and k != "c0_from" for k in p)
        s = make_strategy("lin-decay", p)
        assert s.initial_clip_norm == p["clip_norm"]
        # the searches are cached: resolving again runs nothing
        import dpclip.search.resolve as resolve

        monkeypatch.setattr(resolve, "greedy_search",
                            lambda *a, **k: (_ for _ in ()).throw(AssertionError("reran")))
        assert resolve_strategy_params(cfg, store, progress=False) == resolved
        c0, names, f2 = greedy_c0(cfg, store, runs=3, c_start=0.25, step=0.5, tolerance=0.05,
                                  progress=False)
        assert f2 == firsts and c0 == p["clip_norm"]
    # the same searches in parallel worker processes give the same C0 and thresholds
    from dpclip.search.greedy import greedy_search as real_search

    monkeypatch.setattr(resolve, "greedy_search", real_search)
    monkeypatch.setenv("DPCLIP_SEARCH_WORKERS", "3")
    with ResultsStore(tmp_path / "parallel.db") as store:
        c0_par, _, f_par = greedy_c0(cfg, store, runs=3, c_start=0.25, step=0.5, tolerance=0.05,
                                     progress=False)
        assert len(store.schedules()) == 3
    assert f_par == firsts and c0_par == pytest.approx(p["clip_norm"])
    with pytest.raises(ValueError, match="either clip_norm"):
        resolve_strategy_params(
            TrainConfig(dataset="synthetic", strategy="lin-decay", noise_multiplier=1.0,
                        strategy_params={"c0_from": "greedy", "clip_norm": 1.0}), None)
