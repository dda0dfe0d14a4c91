"""The driver's CPU per announced file, in one process and without Spark.

    python benchmarks/bench_driver.py --tables 1000 --files 1000 --rounds 3
    python benchmarks/bench_driver.py --tables 1000 --files 1000 --rounds 3 --commit
    python benchmarks/bench_driver.py --tables 1000 --files 1000 --profile /tmp/driver.prof

A Spark driver publishes each micro-batch's files (a DataWritten per table, through
:class:`~icefloe.coordination.writer.WriterClient`) and hosts the coordinator, which reads
them back, keeps them pending and, at a cycle, screens and commits them. This script runs
those steps on the real code, one writer and the coordinator in this process, on a real
backend (``--backend``: the machine's Redis by default, its PostgreSQL, or an embedded Kafka
broker) and a SQLite catalog of ``--tables`` tables (created beforehand, as icefloe creates
dynamic tables), and reports each step's CPU (``time.process_time``, every thread of the
process) per file:

* ``publish``: :meth:`WriterClient.publish` of one batch of ``--files`` files spread
  round-robin over the tables (building the events, encoding them, the backend's call);
* ``read``: the coordinator stepping until all of them are pending (reading and decoding
  the events, the reader's bookkeeping of each event and its files);
* ``commit`` (``--commit``): one ``commit_now()`` over every pending file, Iceberg commits
  included, so most of it is per table, not per file.

The files are one real Parquet file's metadata under new names (the committer never opens
data files). The summary gives round 0 and the median of the later rounds: round 0 includes
the first sight of each table (its quarantine and commit boundary read from the catalog),
once per table per leadership.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench_coordinator import backend_options, open_backend, table_names

from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.settings import CatalogSpec
from icefloe.coordination.writer import WriterClient
from icefloe.events import DataFileMeta, SourcePosition
from icefloe.testing.fixtures import (
    create_rows_table,
    sqlite_catalog_properties,
    write_rows,
)
from icefloe.testing.harness import drive, lead
from icefloe_kafka.embedded import EmbeddedKafkaBroker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="redis", choices=("redis", "postgres", "kafka"))
    parser.add_argument("--tables", type=int, default=1000)
    parser.add_argument("--files", type=int, default=1000, help="files per batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", action="store_true", help="also run a commit per round")
    parser.add_argument(
        "--profile", metavar="PATH", help="cProfile (CPU clock) of the rounds after the first"
    )
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-driver-"))
    spec = CatalogSpec("icefloe_test", sqlite_catalog_properties(work / "iceberg"))
    catalog = spec.load()
    names = table_names(args.tables)
    locations = {}
    for name in names:
        locations[name] = create_rows_table(catalog, name).location()
    template = write_rows(catalog.load_table(names[0]), range(10), "template", 0)[0]
    group = f"bench-{uuid.uuid4().hex[:8]}"
    broker = (
        EmbeddedKafkaBroker(log_path=work / "broker.log").start()
        if args.backend == "kafka"
        else None
    )
    options = backend_options(args.backend, broker.bootstrap_servers if broker else None)
    backend = open_backend(args.backend, options, group)
    writer = WriterClient(backend.writer("w00000"), group, "w00000")
    writer.start()
    coordinator = Coordinator(
        group,
        backend.coordinator("bench-driver"),
        catalog,
        CoordinatorSettings(
            commit_interval_s=3600, commit_timeout_s=60, writer_timeout_s=3600, catalog=spec
        ),
    )
    profiler = cProfile.Profile(time.process_time) if args.profile else None
    steps: dict[str, list[float]] = {"publish": [], "read": [], "commit": []}
    try:
        lead(coordinator, timeout=300)
        pending = 0
        for round_ in range(args.rounds):
            files: dict[str, list[DataFileMeta]] = {}
            for i in range(args.files):
                name = names[i % len(names)]
                path = f"{locations[name]}/data/r{round_}-{i}.parquet"
                files.setdefault(name, []).append(dataclasses.replace(template, path=path))
            position = SourcePosition("bench", 0, round_ + 1, int(time.time() * 1000))
            if profiler is not None and round_ > 0:
                profiler.enable()
            cpu = time.process_time()
            writer.publish(round_, files, [position])
            steps["publish"].append(time.process_time() - cpu)
            pending += args.files
            cpu = time.process_time()
            drive(
                coordinator,
                lambda: sum(coordinator.pending_files().values()) >= pending,  # noqa: B023
                f"{pending} pending files",
                timeout=600,
            )
            steps["read"].append(time.process_time() - cpu)
            if args.commit:
                cpu = time.process_time()
                result = coordinator.commit_now()
                steps["commit"].append(time.process_time() - cpu)
                if not result.complete or result.failed:
                    raise SystemExit(f"round {round_}: commit incomplete or failed: {result}")
                pending = 0
            if profiler is not None:
                profiler.disable()
            print(
                f"round {round_}: "
                + ", ".join(
                    f"{k} {v[-1] / args.files * 1000:.3f} ms/file" for k, v in steps.items() if v
                ),
                flush=True,
            )
        if profiler is not None:
            profiler.dump_stats(args.profile)
    finally:
        coordinator.close()
        writer.close()
        backend.close()
        if broker is not None:
            broker.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nbackend={args.backend} tables={args.tables} files={args.files} rounds={args.rounds} "
        f"load(1m)={os.getloadavg()[0]:.1f}"
    )
    for k, v in steps.items():
        if v:  # round 0 apart: it reads every table's state once (first sight)
            steady = statistics.median(v[1:] or v) / args.files * 1000
            first = v[0] / args.files * 1000
            print(f"{k}: round 0 {first:.3f}, later rounds' median {steady:.3f} ms per file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
