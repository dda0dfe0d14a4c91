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
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from pyiceberg.catalog import load_catalog

from icefloe.config import config_from_dict
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


def timed(spent: dict[str, float], stage: str, t0: float) -> float:
    """Add the CPU seconds since ``t0`` to ``stage``; now, for the next stage."""
    now = time.process_time()
    spent[stage] += now - t0
    return now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="the first is the cold one")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="icefloe-bench-task-"))
    props = {
        "type": "sql",
        "uri": f"sqlite:///{root / 'catalog.db'}",
        "warehouse": f"file://{root / 'warehouse'}",
    }
    with EmbeddedKafkaBroker(log_path=root / "broker.log") as broker:
        bootstrap = broker.bootstrap_servers
        create_topic(bootstrap, TOPIC, args.partitions)
        produce(bootstrap, TOPIC, events(0, args.records))
        ends = end_offsets(bootstrap, TOPIC)
        catalog = load_catalog("bench", **props)
        make_table(catalog, "bench.task")
        config = config_from_dict(
            {
                "name": "bench-task",
                "source": {"bootstrap_servers": bootstrap, "topics": [TOPIC]},
                "tables": [{"name": "bench.task"}],
                "catalog": {"name": "bench", "properties": props},
                "coordination": {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap}},
            }
        )
        options = SourceOptions.parse(source_options(config))
        resolver = TableResolver(catalog, config)
        ceilings: list[float] = []
        paths: list[dict[str, float]] = []
        for r in range(args.rounds):
            cpu0 = time.process_time()
            _, n = arrow_ceiling(bootstrap, props, f"{props['warehouse']}/ceiling-{r}", 100_000, {})
            ceiling = time.process_time() - cpu0
            assert n == args.records, f"the ceiling read {n} of {args.records} records"
            spent = dict.fromkeys(STAGES, 0.0)
            for p, end in sorted(ends.items()):
                t = time.process_time()
                batches = list(read_range(options, KafkaInputPartition(TOPIC, p, 0, end)))
                data = pa.Table.from_batches(batches)
                t = timed(spent, "read", t)
                tables, converter = resolver.prepare(data)
                t = timed(spent, "prepare", t)
                source_positions(data)
                t = timed(spent, "positions", t)
                conversion = converter.convert_batch(data)
                t = timed(spent, "convert", t)
                for name, rows in conversion.tables.items():
                    write_data_files(tables[name], rows)
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
            print(
                f"round {r + 1}: ceiling {ceiling:.2f} CPU s, task path {total:.2f} CPU s "
                f"({total / ceiling:.2f}x): " + ", ".join(f"{k} {v:.2f}" for k, v in spent.items()),
                flush=True,
            )
    warm = slice(1, None) if args.rounds > 1 else slice(None)
    ceiling = statistics.median(ceilings[warm])
    stage = {k: statistics.median(p[k] for p in paths[warm]) for k in STAGES}
    total = statistics.median(sum(p.values()) for p in paths[warm])
    cmd = "python benchmarks/bench_task.py " + " ".join(sys.argv[1:])
    print("\nMarkdown row for docs/benchmarks.md (medians of the warm rounds, CPU s):")
    print(
        f"| {datetime.now(UTC):%Y-%m-%d} | `{cmd.strip()}` | {args.records:,} | {ceiling:.2f} | "
        + " | ".join(f"{stage[k]:.2f}" for k in STAGES)
        + f" | {total:.2f} | {total / ceiling:.2f} | {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}, {platform.python_version()} |"
    )


if __name__ == "__main__":
    main()
