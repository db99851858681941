"""Experiment harness: results store (and, later, grids, reports and plots)."""

from dpclip.store import ResultsStore, default_db_path, environment_info

__all__ = ["ResultsStore", "default_db_path", "environment_info"]
