"""Wall seconds of ``icefloe status`` and ``icefloe doctor``, each a fresh process, as an
operator or a health check runs them.

    python benchmarks/bench_health.py [--repeats 3]

A private Tansu broker (source topic and, for ``kafka``, the control topic) and a SQLite
catalog holding the pipeline's table; PostgreSQL and Redis at their usual local ports. Cases:
a healthy pipeline per backend, then one server down at a time (a closed port): the source's
brokers, the backend's server. Reports the median wall time and the exit status per command;
figures go to docs/benchmarks.md by hand.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tomli_w
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from icefloe.testing.fixtures import create_rows_table, make_sqlite_catalog
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


def timed(*args: str, repeats: int) -> tuple[float, int]:
    """Median wall seconds of ``icefloe ARGS`` over ``repeats`` fresh processes, exit status.
    Python may write its bytecode caches, as an installed icefloe has them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times, code = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "icefloe", *args], capture_output=True, env=env, check=False
        )
        times.append(time.perf_counter() - start)
        code = done.returncode
        if SHOW:
            print(done.stdout.decode(), done.stderr.decode()[-3000:], file=sys.stderr)
    return statistics.median(times), code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--show", action="store_true", help="print each command's output")
    parser.add_argument("--only", help="run only the cases of this backend")
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
            create_rows_table(catalog, "bench.health")
            closed = f"127.0.0.1:{free_port()}"
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
            print("| backend | case | status | doctor |")
            print("|---|---|---|---|")
            for i, (backend, case, down, servers) in enumerate(cases):
                if args.only and backend != args.only:
                    continue
                config = {
                    "name": f"health-{i}",
                    "source": {"bootstrap_servers": servers, "topics": [TOPIC]},
                    "tables": [{"name": "bench.health"}],
                    "catalog": {
                        "name": catalog.name,
                        "properties": {"type": "sql", **catalog.properties},
                    },
                    "coordination": backend_section(backend, servers, down),
                }
                path = work / f"p{i}.toml"
                path.write_text(tomli_w.dumps(config))
                status = timed("status", "--config", str(path), repeats=args.repeats)
                doctor = timed("doctor", "--config", str(path), repeats=args.repeats)
                print(
                    f"| {backend} | {case} | {status[0]:.2f} s (exit {status[1]}) "
                    f"| {doctor[0]:.2f} s (exit {doctor[1]}) |",
                    flush=True,
                )
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
