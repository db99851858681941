import sqlite3
import threading

from dpclip.harness.store import ResultsStore


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
