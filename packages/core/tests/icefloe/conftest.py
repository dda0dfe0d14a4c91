"""Core test configuration: the shared fixtures (real SQLite catalog, reference channel).

Imported, not listed in ``pytest_plugins``: pytest only honours that in a rootdir conftest."""

from icefloe.testing.fixtures import memory_server, sqlite_catalog

__all__ = ["memory_server", "sqlite_catalog"]
