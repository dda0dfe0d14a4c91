"""Wall seconds of ``icefloe status`` and ``icefloe doctor``, each a fresh process, as an
operator or a health check runs them.

    python benchmarks/bench_health.py [--repeats 3]

A private Tansu broker (source topic and, for ``kafka``, the control topic) and a SQLite
catalog holding the pipeline's table; PostgreSQL and Redis at their usual local ports. Cases:
a healthy pipeline per backend (two batches committed to the table and one published, not
committed: status reads the table's state and the channel), then one server down at a time (a
closed port): the source's brokers, the backend's server. Reports the median wall time, the
median CPU time (user + system: what the command itself costs, less sensitive to a loaded
machine than wall time), the median wall time less the time the command's main thread was
runnable but waited for a core (Linux's schedstat ``run_delay``, read as the command exits:
what other processes on a loaded machine add, so this is close to the wall time on an idle
machine; "-" where there is no schedstat) and the exit status per command; figures go to
docs/benchmarks.md by hand. ``--healthy``: only the healthy cases.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import tomli_w
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from icefloe.config import config_from_dict
from icefloe.plugins.backends import open_backend
from icefloe.testing.fixtures import make_sqlite_catalog
from icefloe.testing.harness import RowSource, commit_batches
from icefloe_kafka.embedded import EmbeddedKafkaBroker, free_port

TOPIC = "health"
SHOW = False


def backend_section(backend: str, servers: str, down: bool) -> dict[str, Any]:
    """``[coordination]`` for ``backend``; ``down``: its server at a closed port."""
    port = free_port()
    if backend == "kafka":
        return {"backend": "kafka", "kafka": {"bootstrap_servers": servers}}
    if backend == "postgres":
        dsn = f"postgresql://postgres@127.0.0.1:{port if down else 5432}/test"
        return {"backend": "postgres", "postgres": {"dsn": dsn}}
    return {"backend": "redis", "redis": {"url": f"redis://127.0.0.1:{port if down else 6379}"}}


def commit_and_publish(config: dict[str, Any], source: RowSource) -> None:
    """Two batches of a writer committed to the table, a third published and not committed."""
    parsed = config_from_dict(config)
    backend = open_backend(parsed)
    try:
        commit_batches(backend, source.catalog, parsed.name, source, [0, 1], pending=[2])
    finally:
        backend.close()


#: ``python -m icefloe ARGS`` that writes its main thread's run-queue wait (nanoseconds) to
#: stderr as it exits
RUN_ICEFLOE = """
import atexit, runpy, sys

def run_delay():
    try:
        with open("/proc/self/schedstat") as f:
            sys.stderr.write(f"\\nrun-delay-ns {f.read().split()[1]}\\n")
    except OSError:
        pass

atexit.register(run_delay)
sys.argv = ["icefloe", *sys.argv[1:]]
runpy.run_module("icefloe", run_name="__main__", alter_sys=True)
"""


def timed(*args: str, repeats: int) -> tuple[float, float, float | None, int]:
    """Median wall and CPU seconds of ``icefloe ARGS`` over ``repeats`` fresh processes, the
    median wall less the main thread's run-queue wait (None without schedstat), exit status.
    Python may write its bytecode caches, as an installed icefloe has them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times, cpus, unqueued, code = [], [], [], 0
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", RUN_ICEFLOE, *args], capture_output=True, env=env, check=False
        )
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        delays = re.findall(rb"^run-delay-ns (\d+)$", done.stderr, re.MULTILINE)
        if delays:
            unqueued.append(times[-1] - int(delays[-1]) / 1e9)
        code = done.returncode
        if SHOW:
            print(done.stdout.decode(), done.stderr.decode()[-3000:], file=sys.stderr)
    quiet = statistics.median(unqueued) if len(unqueued) == repeats else None
    return statistics.median(times), statistics.median(cpus), quiet, code


def cell(result: tuple[float, float, float | None, int]) -> str:
    """``wall s, CPU s, wall less run-queue wait s (exit)``."""
    wall, cpu, quiet, code = result
    return (
        f"{wall:.2f} s, {cpu:.2f} s, " + ("-" if quiet is None else f"{quiet:.2f} s") + f" ({code})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--show", action="store_true", help="print each command's output")
    parser.add_argument("--only", help="run only the cases of this backend")
    parser.add_argument("--healthy", action="store_true", help="run only the healthy cases")
    args = parser.parse_args()
    global SHOW
    SHOW = args.show
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        broker = EmbeddedKafkaBroker(log_path=work / "broker.log").start()
        try:
            admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
            for f in admin.create_topics([NewTopic(TOPIC, 2, 1)]).values():
                f.result(timeout=20)
            catalog = make_sqlite_catalog(work / "iceberg")
            source = RowSource.create(catalog, ["bench.health"])
            closed = f"127.0.0.1:{free_port()}"
            run = uuid.uuid4().hex[:6]
            cases = [(b, "healthy", False, broker.bootstrap_servers) for b in ("kafka",)]
            cases += [
                (b, "healthy", False, broker.bootstrap_servers) for b in ("postgres", "redis")
            ]
            cases += [("postgres", "source down", False, closed)]
            cases += [
                (b, "backend down", True, broker.bootstrap_servers) for b in ("postgres", "redis")
            ]
            cases += [("kafka", "source and backend down", True, closed)]
            timed("--help", repeats=1)  # writes the bytecode caches of the CLI's modules
            print(
                "| backend | case | status: wall, CPU, wall less run-queue wait (exit) "
                "| doctor: the same |"
            )
            print("|---|---|---|---|")
            for i, (backend, case, down, servers) in enumerate(cases):
                if (args.only and backend != args.only) or (args.healthy and case != "healthy"):
                    continue
                config = {
                    "name": f"health-{run}-{i}",  # new per run: backends keep state
                    "source": {"bootstrap_servers": servers, "topics": [TOPIC]},
                    "tables": [{"name": "bench.health"}],
                    "catalog": {
                        "name": catalog.name,
                        "properties": {"type": "sql", **catalog.properties},
                    },
                    "coordination": backend_section(backend, servers, down),
                }
                if case == "healthy":
                    commit_and_publish(config, source)
                path = work / f"p{i}.toml"
                path.write_text(tomli_w.dumps(config))
                status = timed("status", "--config", str(path), repeats=args.repeats)
                doctor = timed("doctor", "--config", str(path), repeats=args.repeats)
                print(f"| {backend} | {case} | {cell(status)} | {cell(doctor)} |", flush=True)
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
