"""Developer and CI sessions. `nox -l` lists them; each docstring is its help."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "typecheck", "docs", "tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
# package dir -> local packages it depends on (installed from this tree, not an index)
LOCAL_DEPS: dict[str, list[str]] = {
    "core": [],
    "backend-kafka": ["core"],
    "backend-postgres": ["core"],
    "backend-redis": ["core"],
    "spark-runner": ["core", "backend-kafka"],
}
IMPORT_NAMES = {
    "core": "icefloe",
    "backend-kafka": "icefloe_kafka",
    "backend-postgres": "icefloe_postgres",
    "backend-redis": "icefloe_redis",
    "spark-runner": "icefloe_spark",
}
ALL_WITH_TEST_EXTRAS = [f"./packages/{d}[test]" for d in LOCAL_DEPS]


# One pytest-xdist worker per core (every test has its own topic, table, pipeline name and
# session fixtures per worker): more workers than cores starve the tests that hold wall-clock
# leases (four on two cores made them flaky). ICEFLOE_TEST_WORKERS=1 runs them one by one.
WORKERS = os.environ.get("ICEFLOE_TEST_WORKERS", str(os.cpu_count() or 1))
# mypy over what is not shipped: the tests keep a relaxed profile (root pyproject.toml)
TYPED_TESTS = [*[f"packages/{d}/tests" for d in LOCAL_DEPS], "tests", "benchmarks"]


def _pytest_args(session: nox.Session) -> list[str]:
    parallel = [] if WORKERS in ("0", "1") else ["-n", WORKERS, "--dist", "worksteal"]
    return ["-p", "no:cacheprovider", "-rfEs", "--durations=15", *parallel, *session.posargs]


def _install_cached(session: nox.Session, *packages: str) -> None:
    """Install from uv's cache alone when it holds everything (2 s), else from the index. Every
    session installs this way: online, uv builds PySpark's sdist again whenever the index answers
    its revalidation "modified", as the one here does, 40 s for each of the six sessions that
    install PySpark in one CI run."""
    try:
        session.install("--offline", *packages)
    except CommandFailed:
        session.install(*packages)


@nox.session
@nox.parametrize("package", [*LOCAL_DEPS, "e2e"])
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests with only that package and its declared dependencies installed
    (so an undeclared import fails), or `e2e`: the cross-package tests in tests/."""
    if package == "e2e":
        # pip: tests/test_third_party_plugin.py installs a plugin distribution with it;
        # import-linter: tests/test_import_cycles.py runs tools/import_cycles.py (grimp, networkx)
        _install_cached(
            session,
            *ALL_WITH_TEST_EXTRAS,
            "./packages/spark-runner[demo]",
            "pip",
            "psutil>=5.9",
            "ruff>=0.6",
            "mypy>=1.11",
            "import-linter>=2.1",
            "networkx>=3",
        )
        session.run("pytest", "tests", *_pytest_args(session))
        return
    _install_cached(
        session, f"./packages/{package}[test]", *[f"./packages/{d}" for d in LOCAL_DEPS[package]]
    )
    # `.ci/run` sets ICEFLOE_UNIT_TIER_DONE after `nox -s quick` ran every package's unit tier
    # (all five packages installed): here only the tiers that need a server or a JVM run again.
    done = ["-m", "not unit"] if os.environ.get("ICEFLOE_UNIT_TIER_DONE") else []
    session.run("pytest", f"packages/{package}/tests", *done, *_pytest_args(session))


@nox.session
def quick(session: nox.Session) -> None:
    """The fast gate, no server needed: ruff, then every package's unit tier (`pytest -m unit`:
    no server, no JVM) in one virtualenv with all five packages. `.ci/run` runs it first."""
    _install_cached(session, *ALL_WITH_TEST_EXTRAS, "ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    packages = [f"packages/{d}/tests" for d in LOCAL_DEPS]
    session.run("pytest", "-m", "unit", *packages, *_pytest_args(session))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree; the import contracts
    (import-linter, pyproject.toml's [tool.importlinter]) and no import cycle
    (tools/import_cycles.py) over the five packages."""
    _install_cached(
        session, "ruff>=0.6", "import-linter>=2.1", "networkx>=3", *ALL_WITH_TEST_EXTRAS
    )
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")
    session.run("python", "tools/import_cycles.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy (strict) over every package's sources, then over the tests and benchmarks."""
    _install_cached(session, "mypy>=1.11", *ALL_WITH_TEST_EXTRAS, "psutil>=5.9")
    session.run("mypy", *[f"packages/{d}/src/{IMPORT_NAMES[d]}" for d in LOCAL_DEPS])
    session.run("mypy", *TYPED_TESTS)


@nox.session
def docs(session: nox.Session) -> None:
    """Check the docs: relative links resolve, every configuration key is documented, and
    every module, object and repository path the docs name exists (so every package is
    installed, with core's test extra for icefloe.testing)."""
    others = [f"./packages/{d}" for d in LOCAL_DEPS if d != "core"]
    _install_cached(session, "./packages/core[test]", *others)
    session.run("python", "docs/check_docs.py")


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks (not run by default): end-to-end records/s against the single-process
    ceiling on the same data; results go to docs/benchmarks.md by hand."""
    _install_cached(
        session, *ALL_WITH_TEST_EXTRAS, "./packages/spark-runner[demo]", "orjson", "psutil>=5.9"
    )
    session.run("python", "benchmarks/bench_e2e.py", *session.posargs)


@nox.session(name="bench-startup", default=False)
def bench_startup(session: nox.Session) -> None:
    """Start-up benchmark (not run by default): seconds from `icefloe run` to its first table
    commit with default settings, e.g. `nox -s bench-startup -- --repeats 3 --backend kafka`."""
    _install_cached(session, *ALL_WITH_TEST_EXTRAS, "./packages/spark-runner[demo]", "psutil>=5.9")
    session.run("python", "benchmarks/bench_startup.py", *session.posargs)


@nox.session(name="bench-soak", default=False)
def bench_soak(session: nox.Session) -> None:
    """Soak benchmark (not run by default): RSS of the driver, JVM and Python workers of
    `icefloe run` held at full speed, e.g. `nox -s bench-soak -- --minutes 10`."""
    _install_cached(session, *ALL_WITH_TEST_EXTRAS, "./packages/spark-runner[demo]", "psutil>=5.9")
    session.run("python", "benchmarks/bench_soak.py", *session.posargs)


# every script in benchmarks/ with its smallest load: what `bench-smoke` runs
BENCH_SMOKE = {
    "bench_coordinator.py": "--backend kafka --writers 2 --files 4 --cycles 2 --processes 1",
    "bench_driver.py": "--backend kafka --tables 2 --files 4 --rounds 2 --commit",
    "bench_e2e.py": "--records 2000 --warmup 200 --partitions 2 --write 1000",
    "bench_health.py": "--repeats 1 --only kafka",  # the kafka cases need no other server
    "bench_merge.py": "--tasks 2 --partitions 2 --records 200 --cycles 1",
    "bench_soak.py": "--minutes 0.75 --every 3 --window 0.25 --lag 2000 --partitions 2",
    "bench_startup.py": "--repeats 1 --backlog 2000 --until-all",
    "bench_summary.py": "--writer-ids 8 --live 4 --commits 3",
    "bench_task.py": "--records 2000 --partitions 2 --rounds 2",
    "bench_upsert.py": "--rows 2000 --files 2 --updates 100",
    "tansu_stuck_transactions.py": "--producers 2 --rounds 1 --threads 2",
}
# other modes of a script, run after the loads above
BENCH_SMOKE_MODES = [
    ("bench_e2e.py", "--cdc --records 2000 --warmup 200 --keys 500 --partitions 2"),
    ("bench_e2e.py", "--rate 500 --seconds 4 --warmup 200 --partitions 2 --commit-interval 1"),
    ("bench_e2e.py", "--tables 12 --records 2000 --warmup 200 --partitions 2 --write 1000"),
]


@nox.session(name="bench-smoke", default=False)
def bench_smoke(session: nox.Session) -> None:
    """Every benchmark once on a tiny load (not run by default), so none rots: the figures mean
    nothing, a failure does. Needs Java; the broker is embedded, no other server is used."""
    _install_cached(
        session, *ALL_WITH_TEST_EXTRAS, "./packages/spark-runner[demo]", "orjson", "psutil>=5.9"
    )
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    if unlisted := sorted(set(scripts) - set(BENCH_SMOKE)):
        session.error(f"no smoke load for {unlisted}: add one to BENCH_SMOKE in noxfile.py")
    for script in scripts:
        session.run("python", f"benchmarks/{script}", *BENCH_SMOKE[script].split())
    for script, load in BENCH_SMOKE_MODES:
        session.run("python", f"benchmarks/{script}", *load.split())


@nox.session(default=False)
def faults(session: nox.Session) -> None:
    """Randomized fault suite (not run by default): kill -9 of whole `icefloe run` trees at
    random moments, after a publish and after a commit, paused leaders and operator actions,
    per backend, each run counted key by key against the table. `nox -s faults -- --runs 3`;
    `-- --help` lists the options (--backend, --seed, --scenario, --ci, --list)."""
    _install_cached(session, *ALL_WITH_TEST_EXTRAS, "./packages/spark-runner[demo]", "psutil>=5.9")
    session.run("python", "-m", "tests.faults", *session.posargs)


SIMULATION = "packages/core/tests/icefloe/test_simulation.py"
# CI's fixed sets: 1,000 schedules of up to 12 rules, and 100 of up to 40 (long enough to
# reach rollbacks after expiries and swaps)
CI_SIMULATIONS = [
    ["--schedules", "1000", "-n", WORKERS],
    ["--schedules", "100", "--seed", "24000", "--steps", "40"],
]


@nox.session(default=False)
def simulate(session: nox.Session) -> None:
    """The commit-path simulation (not run by default; `.ci/run` runs it): seeded random
    schedules of the real coordinator, committer and writer client over the in-memory channel
    and a SQLite catalog, with crashes, zombies and another engine, checked against invariants
    I1-I4 (docs/reliability.md). Without arguments CI's fixed sets (`CI_SIMULATIONS`); e.g.
    `nox -s simulate -- --schedules 100000 --seed 1 -n 2`, `-- --schedules 100 --seed 24000
    --steps 40` (schedules long enough to reach rollbacks after expiries and swaps), or `--
    --replay VERSION:BLOB` as a failure prints it. Arguments go to pytest (`--schedules --seed
    --steps --replay`, `-n`)."""
    _install_cached(session, "./packages/core[test]")
    runs = [session.posargs] if session.posargs else CI_SIMULATIONS
    for args in runs:
        session.run("pytest", SIMULATION, "-p", "no:cacheprovider", "-rfE", *args)


@nox.session(default=False, python=False)
def build(session: nox.Session) -> None:
    """Wheels of all five distributions into dist/ (or `nox -s build -- DIR`), to install on
    a machine without the clone: `pip install --find-links dist icefloe-core icefloe-backend-...`.
    Needs uv (`pip install nox uv`)."""
    session.run(sys.executable, "tools/build_wheels.py", *session.posargs)


@nox.session(default=False, python=False)
def version(session: nox.Session) -> None:
    """Set every package's version and internal pins from VERSION (`nox -s version -- 0.2.0`
    writes VERSION first)."""
    session.run(sys.executable, "tools/bump_version.py", *session.posargs)


@nox.session(name="bench-coordinator", default=False)
def bench_coordinator(session: nox.Session) -> None:
    """Coordinator benchmark (not run by default): cycle and Iceberg commit time with many
    writers and files, no Spark; e.g. `nox -s bench-coordinator -- --backend redis --writers 64
    --files 10000 --cycles 10`. Results go to docs/benchmarks.md by hand."""
    _install_cached(session, *ALL_WITH_TEST_EXTRAS)
    session.run("python", "benchmarks/bench_coordinator.py", *session.posargs)
