"""Memory over a soak at full speed: does any process of ``icefloe run`` grow?

    nox -s bench-soak -- --minutes 10        # or: python benchmarks/bench_soak.py --minutes 10

Starts the embedded broker and a SQLite catalog, then ``icefloe run`` as a user would (a
TOML file, a subprocess, the default data path and the kafka backend) on bench_e2e's JSON
events. A producer keeps the topic ``--lag`` records ahead of what the table has committed,
so the pipeline never waits for data. Every ``--every`` seconds it samples the resident set
size of each process of the run's tree with psutil, by kind: the driver (the ``icefloe run``
Python process), the JVM, Spark's Python workers (``pyspark.daemon`` and its forks) and
other Python processes (Spark's short-lived planner runners). It prints, per kind, the
largest RSS of one process in the first and the last ``--window`` minutes and over the run,
and the committed rate, plus a Markdown row for docs/benchmarks.md.

Why not inside bench_e2e: that one times a fixed number of records against a ceiling; this
one holds the pipeline saturated for minutes and watches memory, with a user's process tree.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import psutil
import tomli_w
from bench_e2e import TOPIC, committed_rows, events, make_table
from pyiceberg.catalog import load_catalog

from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import create_topic, produce

KINDS = ("driver", "jvm", "workers", "other python")


def kind_of(proc: psutil.Process, driver_pid: int) -> str | None:
    if proc.pid == driver_pid:
        return "driver"
    try:  # a process may end between two calls (the sink's commit runner, every batch)
        cmd = " ".join(proc.cmdline())
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if "java" in name or "org.apache.spark" in cmd:
        return "jvm"
    if "pyspark.daemon" in cmd or "pyspark/daemon" in cmd:
        return "workers"
    return "other python" if "python" in cmd else None


def sample(driver: psutil.Process) -> dict[str, int]:
    """Largest RSS (bytes) of one process per kind, now. Forked workers show the daemon's
    command line, so they count as workers."""
    out: dict[str, int] = defaultdict(int)
    try:
        procs = [driver, *driver.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        kind = kind_of(proc, driver.pid)
        if kind is None:
            continue
        try:
            out[kind] = max(out[kind], proc.memory_info().rss)
        except psutil.NoSuchProcess:
            continue
    return out


def keep_ahead(
    bootstrap: str, catalog_props: dict[str, str], lag: int, stop: threading.Event
) -> list[int]:
    """Produce in chunks while fewer than ``lag`` records wait; returns [produced]."""
    produced = [0]
    catalog = load_catalog("soak", **catalog_props)

    def run() -> None:
        while not stop.is_set():
            if produced[0] - committed_rows(catalog, ["bench.soak"]) < lag:
                produce(bootstrap, TOPIC, events(produced[0], 50_000))
                produced[0] += 50_000
            else:
                stop.wait(0.5)

    threading.Thread(target=run, daemon=True, name="soak-producer").start()
    return produced


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--window", type=float, default=2.0, help="minutes compared, first vs last")
    ap.add_argument("--lag", type=int, default=400_000, help="records kept waiting")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--backend", default="kafka", choices=["kafka", "postgres", "redis"])
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="icefloe-soak-"))
    props = {
        "type": "sql",
        "uri": f"sqlite:///{root / 'catalog.db'}",
        "warehouse": f"file://{root / 'warehouse'}",
    }
    backends = {
        "postgres": {"dsn": "host=127.0.0.1 port=5432 user=postgres dbname=test"},
        "redis": {"url": "redis://127.0.0.1:6379/0"},
    }
    with EmbeddedKafkaBroker(log_path=root / "broker.log") as broker:
        bootstrap = broker.bootstrap_servers
        create_topic(bootstrap, TOPIC, args.partitions)
        make_table(load_catalog("soak", **props), "bench.soak")
        config = {
            "name": f"soak-{int(time.time())}",
            "source": {"bootstrap_servers": bootstrap, "topics": [TOPIC]},
            "tables": [{"name": "bench.soak"}],
            "catalog": {"name": "soak", "properties": props},
            "coordination": {
                "backend": args.backend,
                args.backend: backends.get(args.backend, {"bootstrap_servers": bootstrap}),
            },
            "spark": {"checkpoint_location": str(root / "checkpoint")},
        }
        (root / "soak.toml").write_text(tomli_w.dumps(config))
        stop = threading.Event()
        produced = keep_ahead(bootstrap, props, args.lag, stop)
        proc = subprocess.Popen(
            [sys.executable, "-m", "icefloe", "run", "--config", str(root / "soak.toml")],
            stdout=subprocess.DEVNULL,
            stderr=open(root / "run.log", "wb"),  # noqa: SIM115 - lives as long as the run
            start_new_session=True,
        )
        driver = psutil.Process(proc.pid)
        catalog = load_catalog("soak", **props)
        samples: list[tuple[float, int, dict[str, int]]] = []
        started = time.monotonic()
        try:
            while (elapsed := time.monotonic() - started) < args.minutes * 60:
                if proc.poll() is not None:
                    raise RuntimeError(f"icefloe run exited {proc.returncode}; see {root}/run.log")
                samples.append((elapsed, committed_rows(catalog, ["bench.soak"]), sample(driver)))
                time.sleep(args.every)
        finally:
            stop.set()
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)
    report(args, samples, produced[0])
    shutil.rmtree(root, ignore_errors=True)  # minutes of data; kept only when the run failed


def report(
    args: argparse.Namespace, samples: list[tuple[float, int, dict[str, int]]], produced: int
) -> None:
    window = args.window * 60
    end = samples[-1][0]
    # the first window starts once rows are committed: start-up memory is not growth
    warm = next((t for t, rows, _ in samples if rows > 0), 0.0)
    first = [s for t, _, s in samples if warm <= t < warm + window]
    last = [s for t, _, s in samples if t >= end - window]
    print(f"{len(samples)} samples over {end / 60:.1f} min; first commit after {warm:.0f} s")
    cells = []
    for kind in KINDS:
        peak_first = max((s.get(kind, 0) for s in first), default=0)
        peak_last = max((s.get(kind, 0) for s in last), default=0)
        peak = max((s.get(kind, 0) for _, _, s in samples), default=0)
        growth = peak_last / peak_first if peak_first else float("nan")
        print(
            f"{kind:13}: max RSS first {args.window:g} min {mib(peak_first)} MiB, last "
            f"{mib(peak_last)} MiB ({growth:.2f}x), whole run {mib(peak)} MiB"
        )
        cells.append(f"{mib(peak_first)} / {mib(peak_last)} / {mib(peak)}")
    t_rows = [(t, rows) for t, rows, _ in samples if t >= warm]
    (t0, r0), (t1, r1) = t_rows[0], t_rows[-1]
    rate = (r1 - r0) / (t1 - t0) if t1 > t0 else 0.0
    print(f"committed   : {r1:,} rows ({produced:,} produced), {rate:,.0f} rows/s after warm-up")
    cmd = "python benchmarks/bench_soak.py " + " ".join(sys.argv[1:])
    print("\nMarkdown row for docs/benchmarks.md:")
    print(
        f"| {datetime.now(UTC):%Y-%m-%d} | `{cmd.strip()}` | {args.backend} | "
        + " | ".join(cells)
        + f" | {rate:,.0f} | {os.getloadavg()[0]:.1f} |"
    )


if __name__ == "__main__":
    main()
