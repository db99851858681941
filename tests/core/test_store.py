import sqlite3
import threading

from dpclip.store import ResultsStore


def test_store_round_trip_and_wal(tmp_path):
    path = tmp_path / "x.db"
    with ResultsStore(path) as st:
        rid = st.start_run("abc", {"a": 1})
        st.log_epoch(rid, 1, {"acc": 0.5})
        st.log_epoch(rid, 2, {"acc": 0.6})
        st.finish_run(rid, {"test_accuracy": 0.6}, {"entries": []})
        runs = list(st.runs("finished"))
        assert runs[0]["summary"] == {"test_accuracy": 0.6}
        assert [e["acc"] for e in st.epochs(rid)] == [0.5, 0.6]
        env = runs and sqlite3.connect(path).execute("SELECT environment FROM runs").fetchone()[0]
        assert "dpclip_version" in env
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_store_concurrent_writers(tmp_path):
    path = tmp_path / "y.db"
    ResultsStore(path).close()

    def work(k):
        with ResultsStore(path) as st:
            for i in range(20):
                rid = st.start_run(f"{k}-{i}", {"k": k})
                st.finish_run(rid, {"i": i}, {})

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    with ResultsStore(path) as st:
        assert len(list(st.runs("finished"))) == 80


V1_SCHEMA = """
CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, fingerprint TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed')), created_at REAL NOT NULL,
  finished_at REAL, config TEXT NOT NULL, summary TEXT, ledger TEXT, environment TEXT NOT NULL,
  error TEXT);
CREATE INDEX runs_fingerprint ON runs (fingerprint);
CREATE TABLE epochs (run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
  epoch REAL NOT NULL, metrics TEXT NOT NULL, PRIMARY KEY (run_id, epoch));
INSERT INTO runs VALUES (1, 'fp', 'finished', 0, 1, '{}', '{"test_accuracy": 0.5}', '{}', '{}', NULL);
INSERT INTO epochs VALUES (1, 1, '{"acc": 0.5}');
PRAGMA user_version=1;
"""


def test_v1_database_is_migrated(tmp_path):
    path = tmp_path / "v1.db"
    con = sqlite3.connect(path)
    con.executescript(V1_SCHEMA)
    con.close()
    with ResultsStore(path) as st:
        (run,) = list(st.runs())
        assert run["summary"] == {"test_accuracy": 0.5} and run["experiment"] is None
        assert st.epochs(1) == [{"acc": 0.5}]
        rid = st.start_run("fp2", {}, experiment="e", label="l")
        st.log_epoch(rid, 1, {"acc": 0.7})
        st.mark_interrupted("e")
        assert [r["status"] for r in st.runs()] == ["finished", "interrupted"]
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2
