"""Results do not move (issue 34, the training-config walk): tiny reproducible-noise runs give
the SAME ledger and the SAME final weights (bit for bit) as before the refactoring.

The reference values (``data/refactor_invariance_config.json``) were computed on the code before
the refactoring (commit b8f43ed) by ``tests/core/_invariance_cases.py``; the cases cover
per-example clipping, an adaptive strategy calibrated to epsilon, P-GRAD (AdaClip), public norms
(ALC), batch clipping with public BatchNorm statistics, GBC, Lip-DP-SGD and the own-model API with
the old and the new spelling of the clipping unit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.core._invariance_cases import CASES, fingerprint_run, same_run

REFERENCE = json.loads((Path(__file__).parent / "data" / "refactor_invariance_config.json")
                       .read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_ledger_and_weights_as_before_the_refactoring(name):
    assert name in REFERENCE, f"no reference for {name}: compute it on the old code"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the references were computed (reduction order)
    try:
        got = fingerprint_run(name)
    finally:
        torch.set_num_threads(threads)
    moved = same_run(REFERENCE[name], got)
    assert not moved, moved
