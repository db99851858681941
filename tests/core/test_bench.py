"""The step-time / memory benchmark (dpclip.bench, `dpclip bench`, benchmarks/run_all.py): fast,
CPU only (the CUDA path is exercised on a GPU machine with `run_all.py --device cuda`)."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from dpclip.bench import MEM_RESOLUTION_MB, run_bench
from dpclip.cli import main

REQUIRED = {"model", "batch_size", "method", "device", "allocator", "ms_per_step",
            "ratio_to_nonprivate", "peak_mem_mb", "extra_mem_mb", "base_mem_mb",
            "mem_ratio_to_nonprivate", "extra_mem_ratio_to_nonprivate", "ms_iqr", "engine"}
RUN_ALL = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"


@pytest.fixture(scope="module")
def rows():
    """Two methods timed in-process, no memory probes (fast)."""
    return run_bench("mlp", 4, methods=["dpclip-ghost"], steps=4, warmup=1,
                     measure_memory=False)


@pytest.fixture(scope="module")
def mem_rows():
    """The non-private step with its memory probe (one child process)."""
    return run_bench("mlp", 4, methods=["nonprivate"], steps=2, warmup=1)


@pytest.fixture(scope="module")
def run_all():
    spec = importlib.util.spec_from_file_location("bench_run_all", RUN_ALL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_have_the_fields_and_sane_times(rows):
    assert [r["method"] for r in rows] == ["nonprivate", "dpclip-ghost"]
    for r in rows:
        assert REQUIRED <= set(r)
        assert r["model"] == "mlp" and r["batch_size"] == 4
        assert r["device"] == "cpu" and r["allocator"] in ("glibc", "jemalloc")
        assert r["ms_per_step"] > 0 and r["ratio_to_nonprivate"] > 0
        lo, hi = r["ms_iqr"]
        assert lo <= r["ms_per_step"] <= hi
        assert math.isnan(r["peak_mem_mb"]) and r["extra_mem_ratio_to_nonprivate"] is None
    assert rows[0]["ratio_to_nonprivate"] == 1.0
    assert rows[1]["engine"] == "ghost"


def test_memory_probe_measures_this_method(mem_rows):
    (r,) = mem_rows
    # absolute peak: interpreter + torch, at least tens of MB; the step's own share is tiny
    assert r["peak_mem_mb"] > 10 and r["base_mem_mb"] > 10
    assert r["peak_mem_mb"] >= r["base_mem_mb"]
    assert 0 <= r["extra_mem_mb"] < 50
    assert r["mem_ratio_to_nonprivate"] == 1.0
    # an MLP at batch 4 needs far less than the resolution: no meaningless ratio
    assert r["extra_mem_mb"] < MEM_RESOLUTION_MB and r["extra_mem_ratio_to_nonprivate"] is None


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "nope"}, "unknown bench model 'nope'; valid: mlp"),
    ({"model": "mlp", "methods": ["dpclip-magic"]}, r"unknown bench method.*valid: nonprivate"),
    ({"model": "mlp", "device": "tpu"}, "unknown bench device 'tpu'; valid: cpu, cuda"),
])
def test_unknown_model_method_device_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_bench(batch_size=4, steps=1, warmup=0, measure_memory=False, **kwargs)


def test_cuda_without_cuda_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available.*or use device='cpu'"):
        run_bench("mlp", 4, steps=1, warmup=0, device="cuda")
    rc = main(["bench", "--model", "mlp", "--batch-size", "4", "--device", "cuda"])
    assert rc == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_markdown_from_rows(rows, run_all):
    old = dict(rows[0], method="opacus-hooks", peak_mem_mb=396.0)  # a row from before extra mem
    for k in ("extra_mem_mb", "extra_mem_ratio_to_nonprivate", "device"):
        old.pop(k)
    gpu = [dict(r, device="NVIDIA H100", allocator="cuda-caching", peak_mem_mb=80.0 + i,
                extra_mem_mb=20.0 + i, extra_mem_ratio_to_nonprivate=(20.0 + i) / 20.0)
           for i, r in enumerate(rows)]
    md = run_all.markdown(list(rows) + [old] + gpu)
    cpu_part, gpu_part = md.split("### NVIDIA H100 (cuda-caching)")
    assert cpu_part.startswith(f"### {rows[0]['allocator']}")
    assert "x non-private (CPU time)" in cpu_part and "CPU time" not in gpu_part
    assert "step extra MB" in cpu_part and "step extra MB" in gpu_part
    assert "| mlp | 4 | nonprivate | " in cpu_part
    assert "| mlp | 4 | opacus-hooks | " in cpu_part and "| 396 | - | - |" in cpu_part
    assert "| 81 | 21.0 | 1.05 |" in gpu_part
    assert len([ln for ln in md.splitlines() if ln.startswith("| mlp |")]) == 5
    assert run_all.header("gpu_engines", gpu).startswith("# Step time and peak memory, "
                                                         "`gpu_engines`")


def test_bench_plot_is_a_self_contained_page(tmp_path):
    """issue 35: `dpclip bench --plot FILE.html` draws the step times (a PNG embedded as base64;
    rows as run_bench returns them, made up here to keep the test fast)."""
    from dpclip.bench_plot import bench_report
    from dpclip.cli import build_parser

    args = build_parser().parse_args(["bench", "--model", "mlp", "--batch-size", "8", "--plot",
                                      str(tmp_path / "b.html")])
    assert args.plot == str(tmp_path / "b.html")
    rows = [{"model": "mlp", "batch_size": 8, "method": m, "device": "cpu", "ms_per_step": t,
             "ratio_to_nonprivate": t / 1.0, "peak_mem_mb": 100.0}
            for m, t in (("nonprivate", 1.0), ("dpclip-vmap", 2.5), ("dpclip-ghost", 1.4))]
    page, png = bench_report(rows, tmp_path / "b.html")
    text = page.read_text()
    assert "data:image/png;base64," in text and "<table>" in text and "dpclip-ghost" in text
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="give an .html file"):
        bench_report(rows, tmp_path / "b.png")
