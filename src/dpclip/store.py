"""SQLite results store (stdlib ``sqlite3``, WAL mode): runs, per-epoch metrics and ledgers.

Every ``dpclip train`` run is recorded here. The schema is versioned in ``PRAGMA user_version``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["ResultsStore", "default_db_path", "environment_info", "public_error"]


def public_error(error: str) -> str:
    """A failed run's error text as the store keeps it: the exception type and words, with every
    number replaced by ``#`` (shapes, sizes, counts: a shape's first dimension can be the
    realised, private batch size; a value may be a private datum)."""
    return re.sub(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", "#", str(error))

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    fingerprint   TEXT NOT NULL,
    experiment    TEXT,
    label         TEXT,
    status        TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed', 'interrupted')),
    created_at    REAL NOT NULL,
    finished_at   REAL,
    config        TEXT NOT NULL,
    summary       TEXT,
    ledger        TEXT,
    environment   TEXT NOT NULL,
    error         TEXT
);
CREATE INDEX IF NOT EXISTS runs_fingerprint ON runs (fingerprint);
CREATE INDEX IF NOT EXISTS runs_experiment ON runs (experiment, status);
CREATE TABLE IF NOT EXISTS schedules (
    name        TEXT PRIMARY KEY,
    created_at  REAL NOT NULL,
    metadata    TEXT NOT NULL,
    thresholds  TEXT NOT NULL
);
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
        if version not in (0, 1, SCHEMA_VERSION):
            raise RuntimeError(
                f"{self.path}: schema version {version} is newer than this dpclip understands "
                f"({SCHEMA_VERSION}); upgrade dpclip or use another --db"
            )
        with self._conn:
            if version == 1:
                self._migrate_from_v1()
            self._conn.executescript(_SCHEMA)
            self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _migrate_from_v1(self) -> None:
        """v1 lacked experiment/label and the 'interrupted' status: rebuild ``runs``."""
        self._conn.execute("PRAGMA foreign_keys=OFF")
        # legacy_alter_table keeps the epochs table's foreign key pointing at "runs"
        self._conn.execute("PRAGMA legacy_alter_table=ON")
        self._conn.execute("ALTER TABLE runs RENAME TO runs_v1")
        self._conn.execute("PRAGMA legacy_alter_table=OFF")
        self._conn.execute("DROP INDEX IF EXISTS runs_fingerprint")
        self._conn.executescript(_SCHEMA)
        self._conn.execute(
            "INSERT INTO runs (id, fingerprint, status, created_at, finished_at, config, summary, "
            "ledger, environment, error) SELECT id, fingerprint, status, created_at, finished_at, "
            "config, summary, ledger, environment, error FROM runs_v1"
        )
        self._conn.execute("DROP TABLE runs_v1")
        self._conn.execute("PRAGMA foreign_keys=ON")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "ResultsStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start_run(self, fingerprint: str, config: dict[str, Any], *,
                  experiment: str | None = None, label: str | None = None) -> int:
        with self._conn:
            cur = self._conn.execute(
                "INSERT INTO runs (fingerprint, experiment, label, status, created_at, config, "
                "environment) VALUES (?, ?, ?, 'running', ?, ?, ?)",
                (fingerprint, experiment, label, time.time(), json.dumps(config, sort_keys=True),
                 json.dumps(environment_info())),
            )
            return int(cur.lastrowid)

    def finished_fingerprints(self, experiment: str | None = None) -> set[str]:
        q = "SELECT fingerprint FROM runs WHERE status = 'finished'"
        args: tuple[Any, ...] = ()
        if experiment is not None:
            q += " AND experiment = ?"
            args = (experiment,)
        return {fp for (fp,) in self._conn.execute(q, args)}

    def mark_interrupted(self, experiment: str) -> int:
        """Runs of ``experiment`` left 'running' by a killed runner become 'interrupted'."""
        with self._conn:
            cur = self._conn.execute(
                "UPDATE runs SET status='interrupted' WHERE experiment = ? AND status='running'",
                (experiment,),
            )
            return cur.rowcount

    def save_schedule(self, name: str, thresholds: list[float], metadata: dict[str, Any]) -> None:
        with self._conn:
            self._conn.execute(
                "INSERT OR REPLACE INTO schedules (name, created_at, metadata, thresholds) "
                "VALUES (?, ?, ?, ?)",
                (name, time.time(), json.dumps(metadata), json.dumps(list(thresholds))),
            )

    def schedule(self, name: str) -> tuple[list[float], dict[str, Any]]:
        row = self._conn.execute(
            "SELECT thresholds, metadata FROM schedules WHERE name = ?", (name,)
        ).fetchone()
        if row is None:
            names = [n for (n,) in self._conn.execute("SELECT name FROM schedules ORDER BY name")]
            raise ValueError(f"no threshold schedule named {name!r} in {self.path}; "
                             f"stored schedules: {names}")
        return json.loads(row[0]), json.loads(row[1])

    def has_schedule(self, name: str) -> bool:
        return self._conn.execute(
            "SELECT 1 FROM schedules WHERE name = ?", (name,)
        ).fetchone() is not None

    def schedules(self) -> list[dict[str, Any]]:
        """Every stored threshold schedule: name, created_at, thresholds, metadata (by name)."""
        rows = self._conn.execute(
            "SELECT name, created_at, thresholds, metadata FROM schedules ORDER BY name"
        )
        return [{"name": n, "created_at": c, "thresholds": json.loads(t),
                 "metadata": json.loads(m)} for n, c, t, m in rows]

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

    def interrupt_run(self, run_id: int, message: str) -> None:
        """Ctrl-C: the run stopped at a checkpoint; running the same command resumes it."""
        with self._conn:
            self._conn.execute(
                "UPDATE runs SET status='interrupted', finished_at=?, error=? WHERE id=?",
                (time.time(), message, run_id),
            )

    def fail_run(self, run_id: int, error: str) -> None:
        """Mark a run failed. The stored text is :func:`public_error` of ``error``: exception
        messages quote shapes and sizes (a shape's first dimension can be the realised, private
        batch size), so every number is removed before the text enters the store."""
        error = public_error(error)
        with self._conn:
            self._conn.execute(
                "UPDATE runs SET status='failed', finished_at=?, error=? WHERE id=?",
                (time.time(), error, run_id),
            )

    def runs(self, status: str | None = None, experiment: str | None = None
             ) -> Iterator[dict[str, Any]]:
        q = "SELECT id, fingerprint, experiment, label, status, config, summary, ledger FROM runs"
        conds, args = [], []
        if status is not None:
            conds.append("status = ?")
            args.append(status)
        if experiment is not None:
            conds.append("experiment = ?")
            args.append(experiment)
        if conds:
            q += " WHERE " + " AND ".join(conds)
        for rid, fp, exp, label, st, cfg, summ, led in self._conn.execute(
            q + " ORDER BY id", tuple(args)
        ):
            yield {
                "id": rid, "fingerprint": fp, "experiment": exp, "label": label, "status": st,
                "config": json.loads(cfg),
                "summary": json.loads(summ) if summ else None,
                "ledger": json.loads(led) if led else None,
            }

    def epochs(self, run_id: int) -> list[dict[str, Any]]:
        rows = self._conn.execute(
            "SELECT metrics FROM epochs WHERE run_id = ? ORDER BY epoch", (run_id,)
        )
        return [json.loads(m) for (m,) in rows]
