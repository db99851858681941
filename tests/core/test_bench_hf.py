"""benchmarks/hf_models.py runs (one tiny round on the CPU) and writes its rows and table."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="optional extra: pip install transformers")
pytest.importorskip("opacus", reason="optional extra: pip install opacus")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_models.py"


def test_hf_models_benchmark_smoke(tmp_path):
    mod = runpy.run_path(str(SCRIPT))
    out = tmp_path / "hf.json"
    mod["main"](["--device", "cpu", "--models", "vit", "--rounds", "1", "--warm", "0",
                 "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == list(mod["METHODS"])
    by = {r["method"]: r for r in rows}
    assert by["nonprivate"]["ratio_to_nonprivate"] == 1.0
    for m in ("dpclip-auto", "dpclip-ghost"):
        assert by[m]["engine"] == "ghost" and by[m]["fallback"] is None
        assert by[m]["per_layer"] == ["m.vit.embeddings"]
    assert all(r["device"] == "cpu" and r["torch"] for r in rows)
    assert out.with_suffix(".md").read_text().startswith("# Hugging Face models")
