"""Diagnostic pytest plugin (issue 31, auto's public probe): for every first call of ``auto`` /
``GhostEngine(fallback="vmap")`` that the probe sends to vmap, whether the ghost engine would have
accepted the PRIVATE batch (on a deep copy of the model: a probe verdict that costs speed), and
every error 106 (a private step stopped after the probe chose ghost). One JSON line each.

    PYTHONPATH=src:benchmarks python -m pytest -p auto_verdict_plugin tests/engine/... 

Writes /tmp/auto_verdicts.jsonl (``AUTO_VERDICT_LOG`` to change). Not a test: it runs the model
on ghost after a vmap verdict, which the engine never does."""
import copy, json, os
import pytest
from dpclip.engine import ghost as G

LOG = os.environ.get("AUTO_VERDICT_LOG", "/tmp/auto_verdicts.jsonl")
_real_decided = G.GhostEngine._decided
_cur = {"test": None}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _cur["test"] = item.nodeid


def _decided(self, model, loss_fn, inputs, targets, weight_fn, groups):
    fresh = G._verdict_of(model) is None
    try:
        res = _real_decided(self, model, loss_fn, inputs, targets, weight_fn, groups)
    except G.UnsupportedModelError as exc:
        if "refused a private step at run time" in str(exc):
            with open(LOG, "a") as f:
                f.write(json.dumps({"test": _cur["test"], "kind": "106", "msg": str(exc)[:300]}) + "\n")
        raise
    v = G._verdict_of(model)
    if fresh and v is not None and v.reason is not None:
        would = None
        try:
            m2 = copy.deepcopy(model)
            G.GhostEngine(self.max_physical_batch, self.norm_mode)._run(
                m2, loss_fn, inputs, targets, weight_fn, groups)
            would = "ghost"
        except Exception as exc:  # noqa: BLE001
            would = type(exc).__name__
        with open(LOG, "a") as f:
            f.write(json.dumps({"test": _cur["test"], "kind": "vmap-verdict", "private_on_ghost": would,
                                "reason": v.reason[:200]}) + "\n")
    return res


G.GhostEngine._decided = _decided
