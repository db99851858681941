"""SQLite results store (stdlib ``sqlite3``, WAL mode): runs, per-epoch metrics and ledgers.

Every ``dpclip train`` run is recorded here. The schema is versioned in ``PRAGMA user_version``.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["ResultsStore", "default_db_path", "environment_info"]

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    fingerprint   TEXT NOT NULL,
    status        TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed')),
    created_at    REAL NOT NULL,
    finished_at   REAL,
    config        TEXT NOT NULL,
    summary       TEXT,
    ledger        TEXT,
    environment   TEXT NOT NULL,
    error         TEXT
);
CREATE INDEX IF NOT EXISTS runs_fingerprint ON runs (fingerprint);
CREATE TABLE IF NOT EXISTS epochs (
    run_id   INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    epoch    REAL NOT NULL,
    metrics  TEXT NOT NULL,
    PRIMARY KEY (run_id, epoch)
);
"""


def default_db_path() -> Path:
    """``$DPCLIP_DB`` or ``./dpclip_results.db``."""
    return Path(os.environ.get("DPCLIP_DB", "dpclip_results.db"))


def _git_revision() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment_info() -> dict[str, Any]:
    import torch

    from dpclip import __version__

    return {
        "dpclip_version": __version__,
        "git_revision": _git_revision(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "num_threads": torch.get_num_threads(),
        "allocator": "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc",
    }


class ResultsStore:
    """A thin, safe wrapper over the SQLite database (one connection per store object)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=60.0)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise RuntimeError(
                f"{self.path}: schema version {version} is newer than this dpclip understands "
                f"({SCHEMA_VERSION}); upgrade dpclip or use another --db"
            )
        with self._conn:
            self._conn.executescript(_SCHEMA)
            self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "ResultsStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start_run(self, fingerprint: str, config: dict[str, Any]) -> int:
        with self._conn:
            cur = self._conn.execute(
                "INSERT INTO runs (fingerprint, status, created_at, config, environment) "
                "VALUES (?, 'running', ?, ?, ?)",
                (fingerprint, time.time(), json.dumps(config, sort_keys=True),
                 json.dumps(environment_info())),
            )
            return int(cur.lastrowid)

    def log_epoch(self, run_id: int, epoch: float, metrics: dict[str, Any]) -> None:
        with self._conn:
            self._conn.execute(
                "INSERT OR REPLACE INTO epochs (run_id, epoch, metrics) VALUES (?, ?, ?)",
                (run_id, float(epoch), json.dumps(metrics)),
            )

    def finish_run(self, run_id: int, summary: dict[str, Any], ledger: dict[str, Any]) -> None:
        with self._conn:
            self._conn.execute(
                "UPDATE runs SET status='finished', finished_at=?, summary=?, ledger=? WHERE id=?",
                (time.time(), json.dumps(summary), json.dumps(ledger), run_id),
            )

    def fail_run(self, run_id: int, error: str) -> None:
        with self._conn:
            self._conn.execute(
                "UPDATE runs SET status='failed', finished_at=?, error=? WHERE id=?",
                (time.time(), error, run_id),
            )

    def runs(self, status: str | None = None) -> Iterator[dict[str, Any]]:
        q = "SELECT id, fingerprint, status, config, summary, ledger FROM runs"
        args: tuple[Any, ...] = ()
        if status is not None:
            q += " WHERE status = ?"
            args = (status,)
        for rid, fp, st, cfg, summ, led in self._conn.execute(q + " ORDER BY id", args):
            yield {
                "id": rid, "fingerprint": fp, "status": st, "config": json.loads(cfg),
                "summary": json.loads(summ) if summ else None,
                "ledger": json.loads(led) if led else None,
            }

    def epochs(self, run_id: int) -> list[dict[str, Any]]:
        rows = self._conn.execute(
            "SELECT metrics FROM epochs WHERE run_id = ? ORDER BY epoch", (run_id,)
        )
        return [json.loads(m) for (m,) in rows]
