"""The conformance suite's own mutation test: run it, in a separate pytest process, against the
reference backend (must pass everything) and against each deliberately broken variant of
``broken_backends.py`` (must fail the test of the broken rule, with a message naming it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).parent

#: the end-to-end coordinator scenarios rest on the same rules and take longest: left out
CHANNEL_TESTS_ONLY = (
    "not n_writers_m_cycles and not crash_between_iceberg and not stale_leader_cannot_commit"
)

MODULE = """
from collections.abc import Iterator

import pytest

from broken_backends import MUTANTS
from icefloe.testing.conformance import BackendConformance, BackendFactory
from icefloe.testing.memory import MemoryBackend, MemoryServer, serve_memory_server


class Quick(BackendConformance):
    lease_ttl_s = 1.0
    read_timeout_s = 4.0


class TestReference(Quick):
    @pytest.fixture(scope="class")
    def served(self) -> Iterator[MemoryServer]:
        with serve_memory_server() as (proxy, _):
            yield proxy

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


def _mutants() -> dict[str, tuple[list[str], str]]:
    """Names, expected failing tests and rules, read without importing the module here (it is
    imported by the generated suite, from this directory)."""
    sys.path.insert(0, str(HERE))
    try:
        import broken_backends  # type: ignore[import-not-found]

        return {n: (tests, r) for n, (_, tests, r) in broken_backends.MUTANTS.items()}
    finally:
        sys.path.remove(str(HERE))


def _outcomes(junit: Path) -> dict[tuple[str, str], str | None]:
    """(class, test) -> None when it passed, else the failure message."""
    out: dict[tuple[str, str], str | None] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        out[(cls, case.get("name", ""))] = (
            None if failure is None else (failure.get("message") or "") + (failure.text or "")
        )
    return out


def test_suite_passes_the_reference_and_fails_every_broken_variant(tmp_path: Path) -> None:
    mutants = _mutants()
    module = MODULE + "".join(CLASS.format(name=n) for n in mutants)
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
    reference = {t: msg for (cls, t), msg in outcomes.items() if cls == "TestReference"}
    assert len(reference) >= 20, f"the generated suite did not run: {run.stdout[-2000:]}"
    assert {t: m for t, m in reference.items() if m is not None} == {}, (
        "the reference backend must pass the suite"
    )
    for name, (tests, rule) in mutants.items():
        cls = f"TestMutant_{name}"
        for test in tests:
            assert (cls, test) in outcomes, f"{test} did not run for {name}"
            message = outcomes[(cls, test)]
            assert message is not None, f"the suite passed broken variant {name!r} ({test})"
            assert f"rule '{rule}' of docs/backend-authors.md is broken" in message, (
                f"{name}: {test} failed without naming rule {rule!r}: {message[:500]}"
            )


@pytest.mark.parametrize("name", sorted(_mutants()))
def test_every_variant_names_a_test_that_exists(name: str) -> None:
    """A renamed suite test must not silently turn a mutant's expectation into a no-op."""
    from icefloe.testing.conformance import BackendConformance

    tests, _ = _mutants()[name]
    for test in tests:
        assert callable(getattr(BackendConformance, test, None)), test
