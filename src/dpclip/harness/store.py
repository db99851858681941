"""The results store moved to :mod:`dpclip.store` (a room below the harness, the search and the
federated commands, which all record runs in it); this name is kept for existing imports."""

from dpclip.store import (  # noqa: F401 - re-exported
    SCHEMA_VERSION,
    ResultsStore,
    default_db_path,
    environment_info,
    public_error,
)

__all__ = ["ResultsStore", "default_db_path", "environment_info", "public_error"]
