"""``python -m tests.faults`` (``nox -s faults -- ...``): randomized fault runs per backend
against a real broker, PostgreSQL, Redis, Spark and SQLite catalog; a summary table; exit 1 on
any missing or duplicated record. The closing line reads ``N passed, M failed``."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import random
import socket
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from icefloe_kafka.embedded import EmbeddedKafkaBroker

from .count import Verdict
from .harness import Run, RunError, Settings
from .procs import marked
from .scenarios import REGISTRY, Scenario

BACKENDS = ("kafka", "postgres", "redis")
SERVERS = {"postgres": ("127.0.0.1", 5432, "PostgreSQL"), "redis": ("127.0.0.1", 6379, "Redis")}
console = Console(width=None if sys.stdout.isatty() else 160)


@dataclass
class Outcome:
    backend: str
    scenario: str
    seed: int
    faults: list[str] = field(default_factory=list)
    records: int = 0
    verdict: Verdict | None = None
    error: str | None = None
    dead_lettered: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.verdict is not None and self.verdict.ok


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nox -s faults --", description=__doc__)
    parser.add_argument("--runs", type=int, default=1, help="runs per backend (default 1)")
    parser.add_argument("--backend", default=",".join(BACKENDS), help="comma-separated")
    parser.add_argument("--seed", type=int, default=None, help="master seed (default: random)")
    parser.add_argument(
        "--scenario",
        default=None,
        help="comma-separated names or globs (default: every ready scenario); `--list` shows them",
    )
    parser.add_argument("--ci", action="store_true", help="only the scenarios marked for CI")
    parser.add_argument("--records", type=int, default=3000, help="keys produced per run")
    parser.add_argument("--produce-seconds", type=float, default=30.0)
    parser.add_argument("--catch-up-seconds", type=float, default=900.0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep run files here")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs at once (default 1); each run has its own topic, table and pipeline",
    )
    args = parser.parse_args(argv)
    unknown = set(args.backend.split(",")) - set(BACKENDS)
    if unknown:
        parser.error(f"--backend: unknown {sorted(unknown)}; use some of {', '.join(BACKENDS)}")
    return args


def select(args: argparse.Namespace) -> tuple[list[Scenario], list[str]]:
    """The scenarios to run, and why the others were left out."""
    chosen, left_out = [], []
    patterns = args.scenario.split(",") if args.scenario else None
    for s in REGISTRY.values():
        named = patterns is not None and any(fnmatch.fnmatch(s.name, p) for p in patterns)
        if patterns is not None and not named:
            continue
        if not s.available():
            left_out.append(f"{s.name}: needs the `{s.needs}` feature, not in this tree")
        elif args.ci and not s.ci:
            continue
        elif s.pending and not named:
            left_out.append(f"{s.name}: pending ({s.pending}); run it with --scenario {s.name}")
        else:
            chosen.append(s)
    if patterns is not None and not chosen and not left_out:
        raise SystemExit(f"--scenario {args.scenario}: no such scenario; `--list` shows them")
    return chosen, left_out


def require_servers(backends: list[str]) -> None:
    """A missing server fails the suite loudly (never a silent skip)."""
    for b in backends:
        if b in SERVERS:
            host, port, what = SERVERS[b]
            try:
                socket.create_connection((host, port), timeout=2).close()
            except OSError as exc:
                raise SystemExit(
                    f"{what} is not reachable on {host}:{port} ({exc}); start it"
                ) from None


def one_run(backend: str, sc: Scenario, seed: int, settings: Settings) -> Outcome:
    out = Outcome(backend, sc.name, seed, records=settings.records)
    started = time.monotonic()
    run: Run | None = None
    try:
        run = Run(backend, seed, settings)
        sc.run(run)
        out.verdict = run.verdict()
    except RunError as exc:
        out.error = str(exc)
    except Exception:
        out.error = traceback.format_exc(limit=6)
    finally:
        if run is not None:
            run.kill_all()
            orphans = marked(run.run_id)
            if orphans:
                out.error = (
                    out.error or ""
                ) + f" orphan processes left: {[p.pid for p in orphans]}"
            out.faults = list(run.faults)
            out.dead_lettered = run.dead_lettered
            if out.verdict is None:
                with contextlib.suppress(Exception):
                    out.verdict = run.verdict()  # count anyway: how bad was it
            for note in run.notes:
                console.print(f"  note: {note}")
        out.seconds = time.monotonic() - started
    return out


def report(outcomes: list[Outcome], left_out: list[str], seed: int) -> None:
    table = Table(title=f"fault suite, seed {seed}")
    for col in (
        "backend",
        "scenario",
        "seed",
        "faults",
        "records",
        "rows",
        "missing",
        "dup",
        "dead-lettered",
        "result",
        "s",
    ):
        table.add_column(col)
    for o in outcomes:
        v = o.verdict
        table.add_row(
            o.backend,
            o.scenario,
            str(o.seed),
            str(len(o.faults)),
            str(o.records),
            str(v.rows) if v else "-",
            str(v.missing) if v else "-",
            str(v.duplicated) if v else "-",
            "-" if o.dead_lettered is None else str(o.dead_lettered),
            "ok" if o.ok else "FAIL",
            f"{o.seconds:.0f}",
        )
    console.print(table)
    kinds = Counter(k for o in outcomes for k in o.faults)
    console.print(
        f"runs {len(outcomes)}, faults {sum(kinds.values())} "
        f"({', '.join(f'{k}: {n}' for k, n in sorted(kinds.items())) or 'none'}), "
        f"records {sum(o.records for o in outcomes)}, "
        f"missing {sum(o.verdict.missing for o in outcomes if o.verdict)}, "
        f"duplicated {sum(o.verdict.duplicated for o in outcomes if o.verdict)}"
    )
    for o in outcomes:
        if not o.ok:
            detail = o.error or (o.verdict.describe() if o.verdict else "no verdict")
            console.print(f"[red]FAIL[/red] {o.backend} {o.scenario} seed {o.seed}: {detail}")
            console.print(
                f"  reproduce: nox -s faults -- --runs 1 --backend {o.backend} "
                f"--scenario {o.scenario} --seed {o.seed}"
            )
    for line in left_out:
        console.print(f"not run: {line}")


def plan(
    args: argparse.Namespace, scenarios: list[Scenario], backends: list[str], seed: int
) -> list[tuple[str, Scenario, int]]:
    """(backend, scenario, seed) of every run. Each backend cycles through the scenarios, so
    ``--runs`` at least the number of scenarios covers all of them everywhere; ``--ci`` runs
    each CI scenario on its CI backends. One seed per run: ``--seed S --runs 1 --backend B
    --scenario X`` repeats a run's fault choices."""
    out: list[tuple[str, Scenario, int]] = []
    for index in range(args.runs):
        for b_index, backend in enumerate(backends):
            if args.ci:
                chosen = [s for s in scenarios if backend in s.ci]
            else:
                chosen = [scenarios[(index + b_index) % len(scenarios)]] if scenarios else []
            out += [(backend, s, seed + len(out)) for s in chosen]
    return out


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.list:
        for s in REGISTRY.values():
            flags = [
                f
                for f, on in (
                    (f"ci: {','.join(s.ci)}", s.ci),
                    (f"needs {s.needs}", s.needs),
                    ("pending", s.pending),
                )
                if on
            ]
            print(f"{s.name:26} {s.help}" + (f"  [{', '.join(flags)}]" if flags else ""))
        return 0
    scenarios, left_out = select(args)
    backends = args.backend.split(",")
    require_servers(backends)
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    console.print(
        f"fault suite: seed {seed}, {args.runs} run(s) per backend, backends "
        f"{', '.join(backends)}, scenarios {', '.join(s.name for s in scenarios)}"
    )
    outcomes: list[Outcome] = []
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        broker = stack.enter_context(EmbeddedKafkaBroker(log_path=workdir / "tansu.log"))
        settings = Settings(
            args.records,
            args.produce_seconds,
            args.catch_up_seconds,
            workdir,
            broker.bootstrap_servers,
        )
        runs = plan(args, scenarios, backends, seed)

        def go(index: int) -> Outcome:
            backend, sc, run_seed = runs[index]
            console.print(f"run {index + 1}: {backend} {sc.name} seed {run_seed}")
            outcome = one_run(backend, sc, run_seed, settings)
            verdict = "ok" if outcome.ok else "FAIL"
            console.print(
                f"  run {index + 1} {verdict} in {outcome.seconds:.0f}s, faults: {outcome.faults}"
            )
            return outcome

        # runs are latency-bound (process start-up, commit intervals, waits for a crash
        # point): a few at once finish the suite sooner even on two cores
        with ThreadPoolExecutor(max(1, args.parallel)) as pool:
            outcomes = list(pool.map(go, range(len(runs))))
    report(outcomes, left_out, seed)
    failed = sum(1 for o in outcomes if not o.ok)
    print(f"{len(outcomes) - failed} passed, {failed} failed", flush=True)
    return 1 if failed or not outcomes else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
