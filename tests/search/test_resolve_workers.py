"""The parallel C0 searches need an importable __main__ (spawned workers re-create it)."""

import sys
import types

import pytest

from dpclip.search import resolve


def test_search_workers_fall_back_to_one_when_main_is_stdin(monkeypatch):
    monkeypatch.setenv("DPCLIP_SEARCH_WORKERS", "3")
    fake = types.ModuleType("__main__")
    fake.__file__ = "<stdin>"
    fake.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake)
    with pytest.warns(UserWarning, match="import"):
        assert resolve._search_workers(5) == 1


def test_search_workers_from_a_script_file(monkeypatch, tmp_path):
    monkeypatch.setenv("DPCLIP_SEARCH_WORKERS", "3")
    script = tmp_path / "main.py"
    script.write_text("")
    fake = types.ModuleType("__main__")
    fake.__file__ = str(script)
    fake.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake)
    assert resolve._search_workers(5) == 3
    assert resolve._search_workers(2) == 2
    monkeypatch.setenv("DPCLIP_SEARCH_WORKERS", "x")
    with pytest.raises(ValueError, match="integer"):
        resolve._search_workers(5)
