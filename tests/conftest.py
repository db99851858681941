import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _isolated_db(tmp_path, monkeypatch):
    """Every test writes its results database under its own tmp dir."""
    monkeypatch.setenv("DPCLIP_DB", str(tmp_path / "results.db"))
    # `dpclip train` checkpoints under $DPCLIP_OUT/checkpoints even without --checkpoint-dir
    monkeypatch.setenv("DPCLIP_OUT", str(tmp_path / "out"))
