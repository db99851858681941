"""torch's CPU kernels chosen at ``import dpclip`` (``dpclip.blas_mode.kernels``): its portable
kernels round every element the same wherever it lies in the batch; its vector kernels round a
tensor's last elements otherwise, which a model built to cancel amplified into 2.6 C (seventy-ninth
hostile review; docs/engines.md, "Rounding that depends on the batch size"). Each case runs in a
fresh interpreter (torch reads its choice once per process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOL = 1 + 1e-4


def _fresh(code: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "DPCLIP_CPU_KERNELS")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]),
               OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)


def _vector_kernels_exist() -> bool:
    """whether torch has vector kernels on this CPU (else native and exact are the same code)"""
    out = _fresh("import torch; print(torch.backends.cpu.get_cpu_capability())")
    return out.stdout.strip() != "DEFAULT"


def _sweep(**env: str) -> dict:
    out = _fresh("import sys, kernel_invariance as k; sys.exit(k.main(['--json']))", **env)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return json.loads(out.stdout)


def test_no_pointwise_operator_rounds_an_element_by_its_place_under_dpclip():
    """Every pointwise operator (95 unary, 64 binary, 3 ternary with torch 2.13), four layouts,
    many batch sizes, one and two threads: the first rows computed alone equal the same rows of a
    longer batch, bit for bit."""
    got = _sweep()
    assert got["kernels"] == "exact" and got["capability"] == "DEFAULT"
    assert got["operators"][0] >= 80 and got["operators"][1] >= 50, got["operators"]
    assert got["varying"] == []


def test_torchs_vector_kernels_do_round_by_place():
    """The sweep can fail: with DPCLIP_CPU_KERNELS=native the activations move."""
    if not _vector_kernels_exist():
        pytest.skip("this CPU has no vector kernels: native is the portable code")
    got = _sweep(DPCLIP_CPU_KERNELS="native")
    assert got["kernels"] == "native"
    moved = {v["op"].split(".")[0] for v in got["varying"]}
    assert {"gelu", "silu", "sigmoid", "softplus", "mish"} <= moved, moved


_LOO = ("import dpclip, torch, rounding_loo as r; torch.set_num_threads({t}); "
        "print(dpclip.blas_mode.kernels(), *[r.loo(e, b, torch.float32, model_name='gelu') "
        "for e in ('ghost', 'vmap') for b in (16, 24)])")


@pytest.mark.parametrize("threads", [1, 2])
def test_gelu_between_a_linear_and_a_layernorm_does_not_move_the_others(threads):
    """Review 79's model (a Linear on a constant sequence, GELU, a LayerNorm over the positions,
    inputs of scale 1e6): 2.67 C with torch's vector kernels before the row block; C with dpclip's
    default. (The row block alone, dpclip.engine.batch.padded_rows, now keeps this small model at
    C with the vector kernels too: its tensors are single-threaded and a multiple of 32 long.
    A tensor split between threads still puts a vector kernel's scalar tail on real examples:
    mish on rows of 701 at two threads, benchmarks/results/kernel_invariance_cpu.md's padded
    rows.)"""
    out = _fresh(_LOO.format(t=threads))
    assert out.returncode == 0, out.stderr[-2000:]
    kernels, *loos = out.stdout.split()
    assert kernels == "exact"
    assert max(map(float, loos)) <= TOL, loos


def test_the_choice_is_in_the_summary_and_a_kernel_run_first_is_warned():
    code = ("import warnings, torch; {pre} import dpclip; "
            "m = torch.nn.Linear(3, 2); x, y = torch.randn(4, 3), torch.randint(0, 2, (4,)); "
            "opt = torch.optim.SGD(m.parameters(), lr=0.1); "
            "dp = dpclip.make_private(m, opt, (x, y), noise_multiplier=1.0, steps=2, "
            "batch_size=2, verbose=False); "
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as ws:\n"
            "    for xb, yb in dp.loader:\n"
            "        dp.backward(xb, yb); opt.step(); opt.zero_grad()\n"
            "print(dp.describe()['cpu_kernels'], "
            "sum('vector CPU kernels' in str(w.message) for w in ws))")
    out = _fresh(code.format(pre=""))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["exact", "0"]
    out = _fresh(code.format(pre=""), DPCLIP_CPU_KERNELS="native")
    assert out.returncode == 0, out.stderr[-2000:]
    chosen = "native" if _vector_kernels_exist() else "exact"
    assert out.stdout.split() == [chosen, "0"]  # (chosen by the user: no warning)
    out = _fresh(code.format(pre="torch.nn.functional.gelu(torch.randn(9));"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ([chosen, "1"] if chosen == "native" else ["exact", "0"])


def test_a_bad_choice_is_refused_at_import_naming_the_variable():
    out = _fresh("import dpclip", DPCLIP_CPU_KERNELS="fast")
    assert out.returncode != 0
    assert "DPCLIP_CPU_KERNELS='fast'" in out.stderr and "'native'" in out.stderr


def test_the_ghost_flush_gives_hardshrinks_values_under_either_kernel_choice():
    """ghost flushes tiny entries with a mask under the portable kernels (torch's portable
    hardshrink is ~40x slower): the same values as hardshrink, in place and out of place."""
    import torch
    from dpclip.engine import ghost

    t = torch.randn(1000) * torch.logspace(-45, 2, 1000)
    t[::97] = float("nan")
    t[::89] = float("inf")
    thr = ghost._FLUSH[torch.float32]
    want = torch.nn.functional.hardshrink(t, thr)
    for scalar in (False, True):
        old = ghost._SCALAR_KERNELS[0]
        ghost._SCALAR_KERNELS[0] = scalar
        try:
            got = ghost._shrink(t, thr)
            inplace = t.clone()
            ghost._shrink(inplace, thr, out=inplace)
        finally:
            ghost._SCALAR_KERNELS[0] = old
        for g in (got, inplace):
            assert torch.equal(g.isnan(), want.isnan())
            assert torch.equal(g.nan_to_num(0.0), want.nan_to_num(0.0))
