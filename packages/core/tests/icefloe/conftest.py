"""Core test configuration: the shared fixtures (real SQLite catalog, reference channel, an
S3-compatible object store).

Imported, not listed in ``pytest_plugins``: pytest only honours that in a rootdir conftest."""

from collections.abc import Iterator

import pytest

from icefloe.plugins import manager as plugins_module
from icefloe.testing.fixtures import memory_server, sqlite_catalog
from icefloe.testing.memory import MemoryPlugin
from icefloe.testing.objectstore import s3_catalog_properties, s3_store

__all__ = ["memory_server", "s3_catalog_properties", "s3_store", "sqlite_catalog"]


@pytest.fixture
def memory_plugins() -> Iterator[plugins_module.Plugins]:
    """Process-wide plugins with only the reference backend (``memory``) registered."""
    plugins = plugins_module.new_plugins(autoload=False)
    plugins.pm.register(MemoryPlugin())
    plugins_module.reset_plugins(plugins)
    yield plugins
    plugins_module.reset_plugins(None)


def pytest_addoption(parser: pytest.Parser) -> None:
    """The commit-path simulation's knobs (test_simulation.py; `nox -s simulate -- ...`)."""
    group = parser.getgroup("simulation", "commit-path simulation (test_simulation.py)")
    group.addoption("--schedules", type=int, default=None, help="schedules to run")
    group.addoption("--seed", type=int, default=None, help="seed of the first chunk")
    group.addoption("--steps", type=int, default=None, help="rules per schedule")
    group.addoption(
        "--replay", default=None, help="VERSION:BLOB of a failure: run that schedule alone"
    )
    group.addoption("--plant", default=None, help="a deliberately broken machine (self-test)")
