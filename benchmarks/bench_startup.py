"""Seconds from starting ``icefloe run`` to its first table commit, with the settings a user gets.

A private Tansu broker and SQLite catalog; 40 JSON records wait in a 2-partition topic before
the start, so the figure is start-up alone (Python, JVM, Spark's Python planners and workers,
the first micro-batch, the first cycle). Each repeat is a fresh process, pipeline and table.
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
from confluent_kafka import Producer
from pyiceberg.catalog import load_catalog
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField, StringType

from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import create_topic

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
    work: Path, bootstrap: str, backend: str, when_idle: bool
) -> tuple[float, tuple[float, float], list[str]]:
    """One start: seconds to the first table commit, CPU seconds used until then (all
    processes, the JVM), and the timestamped output lines."""
    topic = f"startup-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 2)
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(40):
        producer.produce(topic, json.dumps({"id": i, "name": f"n{i}"}).encode(), partition=i % 2)
    producer.flush()
    catalog = {
        "type": "sql",
        "uri": f"sqlite:///{work / 'c.db'}",
        "warehouse": f"file://{work / 'wh'}",
    }
    cat = load_catalog("bench", **catalog)
    cat.create_namespace("bench")
    cat.create_table(
        "bench.events",
        Schema(
            NestedField(1, "id", LongType(), required=False),
            NestedField(2, "name", StringType(), required=False),
        ),
    )
    settings = BACKENDS.get(backend, {"bootstrap_servers": bootstrap})
    config = {
        "name": f"startup-{uuid.uuid4().hex[:8]}",
        "source": {"bootstrap_servers": bootstrap, "topics": [topic]},
        "tables": [{"name": "bench.events"}],
        "catalog": {"name": "bench", "properties": catalog},
        "coordination": {"backend": backend, "commit_when_idle": when_idle, backend: settings},
        "spark": {"checkpoint_location": str(work / "checkpoint")},
    }
    (work / "p.toml").write_text(tomli_w.dumps(config))
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
    first = float("nan")
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            at = time.monotonic() - started
            lines.append(f"{at:6.1f} {raw.decode(errors='replace').rstrip()[:160]}")
            if b'"event": "table_commit"' in raw:
                first = at
                break
    finally:
        cpu = sampler.stop()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    return first, cpu, lines


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
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedKafkaBroker() as broker:
        figures = []
        cpus = []
        for i in range(args.repeats):
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            seconds, (cpu, jvm_cpu), lines = one(
                work, broker.bootstrap_servers, args.backend, not args.interval_only
            )
            figures.append(seconds)
            cpus.append(cpu)
            print(
                f"run {i + 1}: first commit {seconds:.1f} s after start, "
                f"CPU {cpu:.1f} s (JVM {jvm_cpu:.1f} s), load {os.getloadavg()[0]:.1f}",
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
