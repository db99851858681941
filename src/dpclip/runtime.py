"""Process-level runtime settings: the fast memory allocator by default for the ``dpclip`` CLI.

With glibc's allocator, the large tensors of a training step are mapped and unmapped on every step
(hundreds of thousands of page faults per CNN step); jemalloc with purging disabled keeps the pages
and makes CPU steps up to several times faster, DP steps more than non-private ones (measured in
``docs/engines.md``). The allocator must be chosen before the process starts, so the CLI
re-executes itself once with ``LD_PRELOAD=<libjemalloc>`` and
``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1`` when the library is installed (Debian package
``libjemalloc2``).

Control it with the environment variable ``DPCLIP_ALLOCATOR``:

* unset or ``auto`` (default): use jemalloc when it is found, otherwise the system allocator;
* ``system``: never re-execute (glibc's malloc);
* ``jemalloc``: like ``auto``, but warn on stderr when jemalloc is not found.

A ``MALLOC_CONF`` already set by the user is kept as it is. The cost is memory: pages freed by a
step stay mapped for the next one, so the peak resident memory can be higher (up to ~1.5x in our
benchmarks). Library users (the Python API) are not affected; they can call
:func:`maybe_reexec_with_jemalloc` first thing in their own script, or set the variables themselves.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "ALLOCATOR_ENV",
    "JEMALLOC_CONF",
    "allocator_in_use",
    "find_jemalloc",
    "maybe_reexec_with_jemalloc",
]

ALLOCATOR_ENV = "DPCLIP_ALLOCATOR"
#: jemalloc without purging: freed pages are kept for reuse (no munmap / page faults per step)
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
_MARKER = "DPCLIP_ALLOCATOR_REEXEC"  # set in the re-executed process: never loop
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


def find_jemalloc() -> str | None:
    """Path of an installed ``libjemalloc.so.2`` (``$DPCLIP_JEMALLOC`` first), or None."""
    paths = [os.environ.get("DPCLIP_JEMALLOC", "")] + list(_CANDIDATES)
    return next((p for p in paths if p and os.path.exists(p)), None)


def allocator_in_use() -> str:
    """``"jemalloc"`` when jemalloc is loaded into this process, else ``"system"``."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            if "libjemalloc" in f.read():
                return "jemalloc"
    except OSError:
        pass
    return "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "system"


def maybe_reexec_with_jemalloc() -> bool:
    """Re-execute this process under jemalloc (no purging) when that is possible and wanted.

    Does nothing and returns False when ``DPCLIP_ALLOCATOR=system``, when jemalloc is already
    loaded (or this process is the re-executed one), when the platform is not Linux, or when the
    library is not installed. Otherwise it replaces the process (``os.execv``, same interpreter and
    command line) and does not return. Call it first thing in a program's entry point, before
    threads or files are opened; never from library code or tests.
    """
    choice = os.environ.get(ALLOCATOR_ENV, "auto").strip().lower()
    if choice not in ("auto", "jemalloc", "system", ""):
        print(f"dpclip: ignoring {ALLOCATOR_ENV}={choice!r} (valid: auto, jemalloc, system)",
              file=sys.stderr)
        choice = "auto"
    if choice == "system" or os.environ.get(_MARKER) or not sys.platform.startswith("linux"):
        return False
    if allocator_in_use() == "jemalloc":
        return False
    lib = find_jemalloc()
    if lib is None:
        if choice == "jemalloc":
            print(f"dpclip: {ALLOCATOR_ENV}=jemalloc but libjemalloc.so.2 was not found (Debian: "
                  "apt-get install libjemalloc2, or set DPCLIP_JEMALLOC=/path/to/lib); using the "
                  "system allocator", file=sys.stderr)
        return False
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    env[_MARKER] = "1"
    orig = getattr(sys, "orig_argv", None)  # the full command line, incl. "-m module" (3.10+)
    argv = [sys.executable] + (list(orig[1:]) if orig else list(sys.argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    return True  # pragma: no cover - not reached
