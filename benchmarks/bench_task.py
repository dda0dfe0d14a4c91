"""CPU of one sink task's stages against the pyarrow ceiling, in one process, no Spark.

    python benchmarks/bench_task.py --records 500000

bench_e2e.py's CPU column says how much more CPU per record the pipeline uses than the
single-process ceiling, but not where; a profile of Spark's processes samples wall time and
moves with the machine's load. This script runs, in one process and on the same events in the
embedded broker, the ceiling (bench_e2e's ``arrow_ceiling``: consume, ``pyarrow.json``,
``pyarrow.parquet``) and then what a sink task of the ``ranges`` path does with each
partition's range, stage by stage, timing each with ``time.process_time`` (every thread of
the process: pyarrow's pool too):

* ``read``: ``read_range`` (consume, messages -> Kafka-layout Arrow batches)
* ``prepare``: the task's tables and converter (``TableResolver.prepare``)
* ``positions``: the source positions the task reports
* ``convert``: decode and conform (``RecordConverter.convert_batch``)
* ``write``: Parquet through pyiceberg's writer (``write_data_files``)
* ``gc``: a full collection after the task, as PySpark's worker daemon runs after every task
  (after the first task has frozen what it left alive, as the sink does)

Round 1 imports, compiles and fills caches; the later rounds are the warm figures, and the
Markdown row gives their medians.

``--tables T`` (T > 1) fans the events out to T dynamic tables by a ``tenant`` field, as
bench_e2e's ``--tables`` above 10 does (``[dynamic_tables]``, namespace ``bench``, the tables
created beforehand), so each task writes a small file per table; ``convert`` is then split into
``route`` (decode and route) and ``conform`` (each table's share into its schema), and the
script reports each stage's CPU per table-file (issue 27: what one small file costs a worker).
The ceiling is skipped for T > 1 (it writes one table). ``--profile PATH`` writes a cProfile
(CPU clock) of the warm rounds' ``convert`` and ``write``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyiceberg.catalog import load_catalog

import icefloe.records.converter as converter_module
from icefloe.config import config_from_dict
from icefloe.records.conform import conform
from icefloe.records.datafiles import write_data_files
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import create_topic, end_offsets, produce
from icefloe_spark.kafka.options import SourceOptions, source_options
from icefloe_spark.kafka.planning import KafkaInputPartition
from icefloe_spark.kafka.reading import read_range
from icefloe_spark.sink.tables import TableResolver
from icefloe_spark.sink.task import source_positions

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import TOPIC, arrow_ceiling, events, make_table

STAGES = ("read", "prepare", "positions", "convert", "write", "gc")
# --tables above 1: convert is split into these two (route = decode and route)
MANY_STAGES = ("read", "prepare", "positions", "route", "conform", "write", "gc")
PER_FILE = ("prepare", "route", "conform", "write")


def timed(spent: dict[str, float], stage: str, t0: float) -> float:
    """Add the CPU seconds since ``t0`` to ``stage``; now, for the next stage."""
    now = time.process_time()
    spent[stage] += now - t0
    return now


class ConformClock:
    """Wraps the converter's ``conform`` to add its CPU seconds to ``spent``, so ``convert``
    splits into routing and conforming without changing the converter (benchmark only)."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.calls = 0
        self.inner = conform

    def __call__(self, *args: Any, **kwargs: Any) -> pa.Table:
        t = time.process_time()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.spent += time.process_time() - t
            self.calls += 1


def pipeline_config(bootstrap: str, props: dict[str, str], tables: int) -> dict[str, Any]:
    """One table, or ``tables`` dynamic ones routed by the events' ``tenant`` field."""
    many = tables > 1
    return {
        "name": "bench-task",
        "source": {"bootstrap_servers": bootstrap, "topics": [TOPIC]},
        "tables": [] if many else [{"name": "bench.task"}],
        **({"dynamic_tables": {"route_field": "tenant", "namespace": "bench"}} if many else {}),
        "catalog": {"name": "bench", "properties": props},
        "coordination": {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap}},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="the first is the cold one")
    ap.add_argument(
        "--tables", type=int, default=1, help="above 1: dynamic tables by a tenant field"
    )
    ap.add_argument("--profile", help="write a cProfile of the warm rounds' convert and write")
    args = ap.parse_args()
    many = args.tables > 1
    stages = MANY_STAGES if many else STAGES
    root = Path(tempfile.mkdtemp(prefix="icefloe-bench-task-"))
    props = {
        "type": "sql",
        "uri": f"sqlite:///{root / 'catalog.db'}",
        "warehouse": f"file://{root / 'warehouse'}",
    }
    with EmbeddedKafkaBroker(log_path=root / "broker.log") as broker:
        bootstrap = broker.bootstrap_servers
        create_topic(bootstrap, TOPIC, args.partitions)
        produce(bootstrap, TOPIC, events(0, args.records, args.tables if many else 0))
        ends = end_offsets(bootstrap, TOPIC)
        catalog = load_catalog("bench", **props)
        for name in [f"bench.t{k}" for k in range(args.tables)] if many else ["bench.task"]:
            make_table(catalog, name)
        config = config_from_dict(pipeline_config(bootstrap, props, args.tables))
        options = SourceOptions.parse(source_options(config))
        resolver = TableResolver(catalog, config)
        clock = ConformClock()
        vars(converter_module)["conform"] = clock  # the name the converter calls
        profiler = cProfile.Profile(time.process_time) if args.profile else None
        ceilings: list[float] = []
        paths: list[dict[str, float]] = []
        file_counts: list[int] = []
        for r in range(args.rounds):
            ceiling = float("nan")
            if not many:
                cpu0 = time.process_time()
                warehouse = f"{props['warehouse']}/ceiling-{r}"
                _, n = arrow_ceiling(bootstrap, props, warehouse, 100_000, {})
                ceiling = time.process_time() - cpu0
                assert n == args.records, f"the ceiling read {n} of {args.records} records"
            spent = dict.fromkeys(stages, 0.0)
            files = 0
            profiling = profiler is not None and r > 0
            for p, end in sorted(ends.items()):
                t = time.process_time()
                batches = list(read_range(options, KafkaInputPartition(TOPIC, p, 0, end)))
                data = pa.Table.from_batches(batches)
                t = timed(spent, "read", t)
                tables, converter = resolver.prepare(data)
                t = timed(spent, "prepare", t)
                source_positions(data)
                t = timed(spent, "positions", t)
                clock.spent = 0.0
                if profiling:
                    assert profiler is not None
                    profiler.enable()
                conversion = converter.convert_batch(data)
                if many:
                    spent["conform"] += clock.spent
                    t = timed(spent, "route", t + clock.spent)
                else:
                    t = timed(spent, "convert", t)
                for name, rows in conversion.tables.items():
                    files += len(write_data_files(tables[name], rows))
                if profiling:
                    assert profiler is not None
                    profiler.disable()
                t = timed(spent, "write", t)
                del batches, data, tables, converter, conversion
                if r == 0 and p == min(ends):  # as the sink's first task: workergc.freeze_once
                    gc.collect()
                    gc.freeze()
                    t = time.process_time()
                gc.collect()
                timed(spent, "gc", t)
            total = sum(spent.values())
            ceilings.append(ceiling)
            paths.append(spent)
            file_counts.append(files)
            against = "" if many else f"ceiling {ceiling:.2f} CPU s, "
            ratio = "" if many else f" ({total / ceiling:.2f}x)"
            print(
                f"round {r + 1}: {against}task path {total:.2f} CPU s{ratio}, {files} files: "
                + ", ".join(f"{k} {v:.2f}" for k, v in spent.items()),
                flush=True,
            )
    if profiler is not None:
        profiler.dump_stats(args.profile)
    warm = slice(1, None) if args.rounds > 1 else slice(None)
    stage = {k: statistics.median(p[k] for p in paths[warm]) for k in stages}
    total = statistics.median(sum(p.values()) for p in paths[warm])
    cmd = "python benchmarks/bench_task.py " + " ".join(sys.argv[1:])
    if many:
        median_files = statistics.median(file_counts[warm])
        per_file = {k: stage[k] / median_files * 1000 for k in PER_FILE}
        print(
            f"\nper table-file ({median_files:.0f} files a round; medians of the warm rounds, "
            "CPU ms):"
        )
        print(", ".join(f"{k} {v:.2f}" for k, v in per_file.items()))
        print(
            f"| `{cmd.strip()}` | {median_files:.0f} | "
            + " | ".join(f"{per_file[k]:.2f}" for k in PER_FILE)
            + f" | {total / median_files * 1000:.2f} | load {os.getloadavg()[0]:.1f} |"
        )
        return
    ceiling = statistics.median(ceilings[warm])
    print("\nMarkdown row for docs/benchmarks.md (medians of the warm rounds, CPU s):")
    print(
        f"| {datetime.now(UTC):%Y-%m-%d} | `{cmd.strip()}` | {args.records:,} | {ceiling:.2f} | "
        + " | ".join(f"{stage[k]:.2f}" for k in STAGES)
        + f" | {total:.2f} | {total / ceiling:.2f} | {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}, {platform.python_version()} |"
    )


if __name__ == "__main__":
    main()
