"""The fast-allocator default of the ``dpclip`` CLI (``dpclip.runtime``): re-execution under jemalloc
without purging when it is installed, the ``DPCLIP_ALLOCATOR`` switch, and no loop."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dpclip.runtime import JEMALLOC_CONF, find_jemalloc

PROBE = (
    "import os, sys;"
    "from dpclip.runtime import maybe_reexec_with_jemalloc, allocator_in_use;"
    "maybe_reexec_with_jemalloc();"
    "print(allocator_in_use(), os.environ.get('MALLOC_CONF', ''), sys.argv[1:], sep='|')"
)


def _probe(extra_env: dict[str, str], *args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "MALLOC_CONF", "DPCLIP_ALLOCATOR", "DPCLIP_ALLOCATOR_REEXEC")}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1].split("|")


needs_jemalloc = pytest.mark.skipif(
    find_jemalloc() is None or not sys.platform.startswith("linux"),
    reason="libjemalloc2 is not installed",
)


@needs_jemalloc
def test_default_reexecutes_under_jemalloc_without_purging_and_keeps_arguments():
    alloc, conf, argv = _probe({}, "--flag", "x y")
    assert alloc == "jemalloc"
    assert conf == JEMALLOC_CONF
    assert argv == str(["--flag", "x y"])


@needs_jemalloc
def test_user_malloc_conf_is_kept():
    alloc, conf, _ = _probe({"MALLOC_CONF": "narenas:1"})
    assert (alloc, conf) == ("jemalloc", "narenas:1")


def test_system_switch_turns_it_off():
    alloc, conf, _ = _probe({"DPCLIP_ALLOCATOR": "system"})
    assert (alloc, conf) == ("system", "")


def test_missing_library_falls_back_with_a_warning_when_jemalloc_is_asked_for(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    env.update(DPCLIP_ALLOCATOR="jemalloc", DPCLIP_JEMALLOC=str(tmp_path / "nope.so"))
    code = ("import dpclip.runtime as r; r._CANDIDATES = ();"
            "print(r.maybe_reexec_with_jemalloc(), r.allocator_in_use())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "system"]
    assert "libjemalloc.so.2 was not found" in out.stderr


@needs_jemalloc
def test_cli_entry_runs_under_jemalloc_but_bench_keeps_the_given_allocator():
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "MALLOC_CONF", "DPCLIP_ALLOCATOR", "DPCLIP_ALLOCATOR_REEXEC")}
    code = ("import sys; from dpclip import cli, runtime;"
            "cli.main = lambda: print(runtime.allocator_in_use()) or 0;"
            "sys.argv = ['dpclip'] + sys.argv[1:]; cli.entry()")
    seen = {}
    for sub in ("strategies", "bench"):
        out = subprocess.run([sys.executable, "-c", code, sub], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        seen[sub] = out.stdout.strip().splitlines()[-1]
    assert seen == {"strategies": "jemalloc", "bench": "system"}
