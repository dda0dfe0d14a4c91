"""The conformance suite's own mutation test: run it, in a separate pytest process, against the
reference backend (must pass everything) and against each deliberately broken variant of
``broken_backends.py`` (must fail the test of the broken rule, with a message naming it), and
against variants that lack part of the contract (must report each missing part once, under
the rule that needs it, and skip the other tests that need it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent

#: the end-to-end coordinator scenarios rest on the same rules and take longest: left out
CHANNEL_TESTS_ONLY = (
    "not n_writers_m_cycles and not crash_between_iceberg and not stale_leader_cannot_commit"
)

MODULE = """
from collections.abc import Iterator

import pytest

from broken_backends import MISSING, MUTANTS
from icefloe.testing.conformance import BackendConformance, BackendFactory, StoreRecreator
from icefloe.testing.memory import (
    MemoryBackend,
    MemoryServer,
    recreate_memory_store,
    serve_memory_server,
)
from icefloe.testing.rules.support import SuiteBase


class Quick(BackendConformance):
    lease_ttl_s = 1.0
    read_timeout_s = 4.0

    @pytest.fixture(scope="class")
    def served(self) -> Iterator[MemoryServer]:
        with serve_memory_server() as (proxy, _):
            yield proxy

    @pytest.fixture
    def recreate_store(self) -> StoreRecreator:
        return recreate_memory_store


class TestReference(Quick):
    @pytest.fixture
    def backend_factory(self, served: MemoryServer) -> BackendFactory:
        return lambda group_id, ttl: MemoryBackend(served, group_id, ttl)
"""

CLASS = """

class TestMutant_{name}(Quick):
    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return MUTANTS["{name}"][0]()
"""

MISSING_CLASS = """

class TestMissing_{name}(Quick):
    @pytest.fixture
    def backend_factory(self, served: MemoryServer) -> BackendFactory:
        return MISSING["{name}"][0](served)
"""

#: what a test class that does not provide ``recreate_store`` has: the suite's default
WITHOUT_RECREATE = """
    recreate_store = SuiteBase.recreate_store
"""


def _broken_backends() -> Any:
    """The variants' module, imported without leaving this directory on sys.path (the
    generated suite imports it itself, from this directory)."""
    sys.path.insert(0, str(HERE))
    try:
        import broken_backends  # type: ignore[import-not-found]

        return broken_backends
    finally:
        sys.path.remove(str(HERE))


def _mutants() -> dict[str, tuple[list[str], str]]:
    """Names, expected failing tests and rules."""
    return {n: (tests, r) for n, (_, tests, r) in _broken_backends().MUTANTS.items()}


def _missing() -> dict[str, tuple[bool, dict[str, str]]]:
    """Names, whether the class provides ``recreate_store``, expected failing tests: rules."""
    return {n: (fixture, fails) for n, (_, fixture, fails) in _broken_backends().MISSING.items()}


def _outcomes(junit: Path) -> dict[tuple[str, str], tuple[str, str | None]]:
    """(class, test) -> ("passed", None), or ("failed" | "skipped", the message)."""
    out: dict[tuple[str, str], tuple[str, str | None]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        status, found = "passed", None
        for tag, meaning in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None and found is None:
                status, found = meaning, element
        out[(cls, case.get("name", ""))] = (
            status,
            None if found is None else (found.get("message") or "") + (found.text or ""),
        )
    return out


def test_suite_passes_the_reference_and_fails_every_broken_variant(tmp_path: Path) -> None:
    mutants, missing = _mutants(), _missing()
    module = MODULE + "".join(CLASS.format(name=n) for n in mutants)
    module += "".join(
        MISSING_CLASS.format(name=n) + ("" if fixture else WITHOUT_RECREATE)
        for n, (fixture, _) in missing.items()
    )
    (tmp_path / "test_generated_suite.py").write_text(textwrap.dedent(module))
    junit = tmp_path / "junit.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    # the reference runs every channel test; each variant the test of the rule it breaks
    suite = tmp_path / "test_generated_suite.py"
    nodes = [f"{suite}::TestReference"] + [
        f"{suite}::TestMutant_{name}::{test}"
        for name, (tests, _) in mutants.items()
        for test in tests
    ]
    nodes += [f"{suite}::TestMissing_{name}" for name in missing]
    run = subprocess.run(
        [
            sys.executable,
            *("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "icefloe.testing.fixtures"),
            *("-k", CHANNEL_TESTS_ONLY, f"--junitxml={junit}", "--rootdir", str(tmp_path)),
            *nodes,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    assert junit.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    outcomes = _outcomes(junit)
    reference = {t: out for (cls, t), out in outcomes.items() if cls == "TestReference"}
    assert len(reference) >= 20, f"the generated suite did not run: {run.stdout[-2000:]}"
    assert {t: out for t, out in reference.items() if out[0] != "passed"} == {}, (
        "the reference backend must pass the suite"
    )
    for name, (tests, rule) in mutants.items():
        cls = f"TestMutant_{name}"
        for test in tests:
            assert (cls, test) in outcomes, f"{test} did not run for {name}"
            status, message = outcomes[(cls, test)]
            assert status == "failed", f"the suite passed broken variant {name!r} ({test})"
            assert f"rule '{rule}' of docs/backend-authors.md is broken" in str(message), (
                f"{name}: {test} failed without naming rule {rule!r}: {str(message)[:500]}"
            )
    for name, (_, fails) in missing.items():
        _check_reported_once(name, fails, outcomes, set(reference))


def _check_reported_once(
    name: str,
    fails: dict[str, str],
    outcomes: dict[tuple[str, str], tuple[str, str | None]],
    tests: set[str],
) -> None:
    """The variant's missing parts fail exactly the tests that report them, each naming its
    rule and what is missing; every other test passes or is skipped naming the reporter."""
    got = {t: out for (cls, t), out in outcomes.items() if cls == f"TestMissing_{name}"}
    assert set(got) == tests, f"{name}: not every channel test ran"
    failed = {t: message for t, (status, message) in got.items() if status == "failed"}
    assert set(failed) == set(fails), f"{name}: failed {sorted(failed)}, not {sorted(fails)}"
    for test, rule in fails.items():
        assert f"rule '{rule}' of docs/backend-authors.md is broken" in str(failed[test]), (
            f"{name}: {test} does not name rule {rule!r}: {str(failed[test])[:500]}"
        )
        assert "not implemented" in str(failed[test]) or "not provided" in str(failed[test])
    for test, (status, message) in got.items():
        if status == "skipped":
            assert any(reporter in str(message) for reporter in fails), (
                f"{name}: {test} skipped without naming the test that reports it: {message}"
            )


@pytest.mark.parametrize("name", sorted(_mutants()))
def test_every_variant_names_a_test_that_exists(name: str) -> None:
    """A renamed suite test must not silently turn a mutant's expectation into a no-op."""
    from icefloe.testing.conformance import BackendConformance

    tests, _ = _mutants()[name]
    for test in tests:
        assert callable(getattr(BackendConformance, test, None)), test


def test_every_part_of_the_contract_is_reported_by_one_test_of_its_rule() -> None:
    """What makes "a missing method is reported once, under its rule" hold for every method:
    each required method (and fixture) has one reporting test, of the rule the contract
    gives it, and every rule the contract names is one the suite checks."""
    from icefloe.channel import (
        CONTRACT_CHANGES,
        METHOD_RULES,
        Backend,
        CoordinatorChannel,
        WriterChannel,
    )
    from icefloe.testing.conformance import RULES, BackendConformance
    from icefloe.testing.rules.support import FIXTURE_RULES, REPORTED_BY

    abstract = {
        f"{cls.__name__}.{method}"
        for cls in (Backend, WriterChannel, CoordinatorChannel)
        for method in cls.__abstractmethods__
    }
    assert set(METHOD_RULES) == abstract | {"Backend.inject_undecodable"}
    for name, rule in {**METHOD_RULES, **FIXTURE_RULES}.items():
        test = getattr(BackendConformance, REPORTED_BY[name])
        assert (test.rule, name in test.reports) == (rule, True), name
    named = {c.rule for changes in CONTRACT_CHANGES.values() for c in changes} - {None}
    assert named <= set(RULES)
