"""The weight probe of the invariance references (tests/core/_invariance_cases.py): a weight hash
that differs in the last bits on another CPU is accepted only when the probe agrees, and the probe
sees a real change."""

from __future__ import annotations

import torch
from torch import nn

from tests.core._invariance_cases import PROBE_RTOL, same_run, state_hash, weights_probe


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))


def _record(m: nn.Module) -> dict:
    return {"ledger": "L", "state_sha256": state_hash(m), "state_probe": weights_probe(m)}


def test_last_bits_pass_and_a_real_change_does_not():
    m = _model()
    ref = _record(m)
    assert same_run(ref, _record(m)) == {}
    with torch.no_grad():  # the last bits of every weight (another CPU's summation order)
        for p in m.parameters():
            p.mul_(1 + 2 ** -22)
    got = _record(m)
    assert got["state_sha256"] != ref["state_sha256"]
    assert same_run(ref, got) == {}
    with torch.no_grad():  # one weight moved by 10x the tolerance of the norm: a real change
        w = m[0].weight
        w[0, 0] += 10 * PROBE_RTOL * weights_probe(m)["norm"]
    assert set(same_run(ref, _record(m))) == {"state_sha256", "state_probe"}


def test_counters_and_ledgers_stay_exact():
    m = _model()
    ref = _record(m)
    m[1].num_batches_tracked += 1
    assert "state_sha256" in same_run(ref, _record(m))
    assert same_run(ref, {**_record(_model()), "ledger": "other"}) == {"ledger": ("L", "other")}
