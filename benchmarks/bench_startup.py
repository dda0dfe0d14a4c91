"""Seconds from starting ``icefloe run`` to its first table commit, with the settings a user gets.

A private Tansu broker and SQLite catalog; 40 JSON records (bench_e2e's events) wait in a
2-partition topic before the start, so the figure is start-up alone (Python, JVM, Spark's
Python planners and workers, the first micro-batch, the first cycle). ``--backlog N``
(``--partitions P``) makes N records wait instead: the first micro-batch is then as large as
``source.first_batch_records`` lets it be (``--first-batch``; default: the configuration's),
so the figure is what an operator waits for on a backlog. Each repeat is a fresh process,
pipeline and table.
Run by ``nox -s bench-startup -- --repeats 3 [--backend kafka]``; figures go to
docs/benchmarks.md by hand. Each run also reports the CPU seconds its processes used until the
first commit (driver, Spark's JVM, its Python processes; the JVM's share apart): on a shared
machine the wall time depends on the others' load, the CPU time much less.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import tomli_w
from bench_e2e import events, make_table
from pyiceberg.catalog import load_catalog

from icefloe.config import SourceConfig
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import create_topic, produce

LOG_JSON = ("--log-format", "json")
BACKENDS: dict[str, dict[str, Any]] = {
    "postgres": {"dsn": "host=127.0.0.1 port=5432 user=postgres dbname=test"},
    "redis": {"url": "redis://127.0.0.1:6379/0"},
}


class CpuSampler:
    """CPU seconds of a process and all its descendants, sampled until stopped (a process
    that ends between two samples counts with its last sample)."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.seen: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                tree = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            for p in tree:
                try:
                    times = p.cpu_times()
                    self.seen[p.pid] = (p.name(), times.user + times.system)
                except psutil.Error:
                    pass

    def stop(self) -> tuple[float, float]:
        """(all processes, the JVM) CPU seconds."""
        self._stop.set()
        self._thread.join()
        total = sum(cpu for _, cpu in self.seen.values())
        return total, sum(cpu for name, cpu in self.seen.values() if name == "java")


def one(
    work: Path, bootstrap: str, backend: str, when_idle: bool, args: argparse.Namespace
) -> tuple[float, float, float, tuple[float, float], list[str]]:
    """One start: seconds to the first table commit, to the commit of the whole backlog and
    to the last data file's write (both with ``--until-all``, else NaN), CPU seconds used
    until the first (all processes, the JVM), and the timestamped output lines."""
    topic = f"startup-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, args.partitions)
    produce(bootstrap, topic, events(0, args.backlog))
    catalog = {
        "type": "sql",
        "uri": f"sqlite:///{work / 'c.db'}",
        "warehouse": f"file://{work / 'wh'}",
    }
    make_table(load_catalog("bench", **catalog), "bench.events")
    settings = BACKENDS.get(backend, {"bootstrap_servers": bootstrap})
    config = {
        "name": f"startup-{uuid.uuid4().hex[:8]}",
        "source": {
            "bootstrap_servers": bootstrap,
            "topics": [topic],
            **({} if args.first_batch is None else {"first_batch_records": args.first_batch}),
        },
        "tables": [{"name": "bench.events"}],
        "catalog": {"name": "bench", "properties": catalog},
        "coordination": {"backend": backend, "commit_when_idle": when_idle, backend: settings},
        "spark": {"checkpoint_location": str(work / "checkpoint")},
    }
    (work / "p.toml").write_text(tomli_w.dumps(config))
    started_epoch = time.time()  # the data files' modification times are on this clock
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "icefloe", "run", "--config", str(work / "p.toml"), *LOG_JSON],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    sampler = CpuSampler(proc.pid)
    lines: list[str] = []
    first = whole = float("nan")
    cpu = (0.0, 0.0)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            at = time.monotonic() - started
            lines.append(f"{at:6.1f} {raw.decode(errors='replace').rstrip()[:160]}")
            if b'"event": "table_commit"' not in raw:
                continue
            if first != first:  # NaN: this is the first commit
                first, cpu = at, sampler.stop()
            if not args.until_all or (json.loads(raw).get("rows") or 0) >= args.backlog:
                whole = at if args.until_all else whole
                break
    finally:
        sampler.stop()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    data_s = data_written(work / "wh", started_epoch) if args.until_all else float("nan")
    return first, whole, data_s, cpu, lines


def data_written(warehouse: Path, started_epoch: float) -> float:
    """Seconds from the start until the last Parquet file under ``warehouse`` was written:
    the data path's own pace (issue 29's "data-path rate"), which the commit times hide
    behind the commit interval (the last commit waits for the next cycle). Read from the
    files' modification times, not from the pipeline's reports."""
    return max(f.stat().st_mtime for f in warehouse.rglob("*.parquet")) - started_epoch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="kafka", choices=["kafka", *BACKENDS])
    ap.add_argument("--verbose", action="store_true", help="print each run's output lines")
    ap.add_argument(
        "--interval-only",
        action="store_true",
        help="coordination.commit_when_idle = false (cycles only every commit_interval_s)",
    )
    ap.add_argument("--backlog", type=int, default=40, help="records waiting at the start")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument(
        "--until-all",
        action="store_true",
        help="also wait until the whole backlog is committed and report when",
    )
    ap.add_argument(
        "--first-batch",
        type=int,
        default=None,
        help="source.first_batch_records (default: the configuration's, "
        f"{SourceConfig.model_fields['first_batch_records'].default:,}); "
        "the size of source.max_records_per_batch means no ramp",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedKafkaBroker() as broker:
        figures = []
        cpus = []
        for i in range(args.repeats):
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            seconds, whole, data_s, (cpu, jvm_cpu), lines = one(
                work, broker.bootstrap_servers, args.backend, not args.interval_only, args
            )
            figures.append(seconds)
            cpus.append(cpu)
            rest = ""
            if args.until_all:
                rest = (
                    f"; all {args.backlog:,} rows {whole:.1f} s after start "
                    f"({args.backlog / whole:,.0f} records/s, start-up included), their data "
                    f"files written by {data_s:.1f} s ({args.backlog / data_s:,.0f} records/s)"
                )
            print(
                f"run {i + 1}: first commit {seconds:.1f} s after start, "
                f"CPU {cpu:.1f} s (JVM {jvm_cpu:.1f} s){rest}, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            if args.verbose:
                print("\n".join(lines))
        print(
            f"{args.backend}: first commit median {statistics.median(figures):.1f} s "
            f"(min {min(figures):.1f}, max {max(figures):.1f}, {len(figures)} runs), "
            f"CPU median {statistics.median(cpus):.1f} s, load {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
