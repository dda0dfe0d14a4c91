"""A pytest plugin that puts every test in exactly one tier, by what it needs to run:

* ``unit``: no server and no JVM: Python code, local files and SQLite catalogs;
* ``integration``: a real PostgreSQL, Redis or Kafka-protocol broker;
* ``spark``: a Spark JVM;
* ``e2e``: whole pipelines across packages.

Load it with ``-p icefloe.testing.tiers`` (the packages' ``addopts`` do) so ``pytest -m unit``
is a gate that needs no server and no setup. A test's tier is the tier marker it carries (on
the test, its class or its module's ``pytestmark``: for tests that start servers or JVMs
without a fixture), else, first match wins: ``e2e`` under a ``tier_e2e_paths`` directory;
``spark`` or ``integration`` when it uses, even indirectly, a fixture listed in
``tier_spark_fixtures`` or ``tier_integration_fixtures``; else ``unit``. Two tier markers on
one test, or ``unit`` on one that uses a server fixture, stop the run. The markers are
registered here too when a configuration does not list them (this repository's do).

It also starts every test from the logging set-up the run began with (levels of every logger,
the root's handlers): a CLI command run in-process (``icefloe.cli.logs.configure``) quiets
loggers such as ``icefloe.coordinator.cycles``, and a later test on the same worker, in any
package, that asserts their lines saw none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

TIERS = {
    "unit": "needs no server and no JVM (Python code, local files, SQLite catalogs)",
    "integration": "talks to a real PostgreSQL, Redis or Kafka-protocol broker",
    "spark": "starts a Spark JVM",
    "e2e": "cross-package, whole pipelines",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "tier_integration_fixtures",
        "fixtures that need a real server: tests using them are `integration`",
        type="args",
        default=[],
    )
    parser.addini(
        "tier_spark_fixtures",
        "fixtures that start a Spark JVM: tests using them are `spark`",
        type="args",
        default=[],
    )
    parser.addini(
        "tier_e2e_paths",
        "directories, relative to the rootdir, whose tests are `e2e`",
        type="args",
        default=[],
    )


@dataclass
class _LoggingSetUp:
    """The levels of every logger and the root's handlers, as the run began."""

    handlers: list[logging.Handler] = field(default_factory=list)
    levels: dict[str, int] = field(default_factory=dict)

    @classmethod
    def now(cls) -> _LoggingSetUp:
        names = ["", *logging.root.manager.loggerDict]
        return cls(
            list(logging.getLogger().handlers), {n: logging.getLogger(n).level for n in names}
        )

    def restore(self) -> None:
        logging.getLogger().handlers[:] = self.handlers
        for name in ["", *logging.root.manager.loggerDict]:
            logging.getLogger(name).setLevel(self.levels.get(name, logging.NOTSET))


_INITIAL: list[_LoggingSetUp] = []


@pytest.fixture(autouse=True)
def _logging_as_the_run_began() -> Iterator[None]:
    """Restore the run's initial logging set-up around each test (see the module docstring)."""
    if _INITIAL:
        _INITIAL[0].restore()
    yield
    if _INITIAL:  # also after it, so a test that changes logging cleans up itself
        _INITIAL[0].restore()


def pytest_configure(config: pytest.Config) -> None:
    """Register the tiers a configuration left out (``--strict-markers`` refuses unknown ones);
    note the logging set-up the run begins with."""
    _INITIAL[:] = [_LoggingSetUp.now()]
    known = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for tier, meaning in TIERS.items():
        if tier not in known:
            config.addinivalue_line("markers", f"{tier}: {meaning}")


def tier_of(item: pytest.Item) -> str:
    """The tier ``item`` belongs to (see the module docstring for the order of the rules)."""
    config = item.config
    used = set(getattr(item, "fixturenames", ()))  # the closure: indirect uses count too
    if any(item.path.is_relative_to(config.rootpath / p) for p in config.getini("tier_e2e_paths")):
        found = "e2e"
    elif used & set(config.getini("tier_spark_fixtures")):
        found = "spark"
    elif used & set(config.getini("tier_integration_fixtures")):
        found = "integration"
    else:
        found = "unit"
    marked = {m.name for m in item.iter_markers() if m.name in TIERS}
    if len(marked) > 1:
        raise pytest.UsageError(f"{item.nodeid}: one tier only, not {sorted(marked)}")
    if marked == {"unit"} and found != "unit":
        raise pytest.UsageError(f"{item.nodeid} is marked unit but needs {found}")
    return marked.pop() if marked else found


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        if not item.get_closest_marker(tier):
            item.add_marker(tier)
