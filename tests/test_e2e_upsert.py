"""Upsert and CDC end to end: Kafka (Tansu) -> ``icefloe run`` / Pipeline (Spark) -> Iceberg
row deltas, checked against the final state the produced changes imply.

Each table is read twice, by readers that are not the committer's code: pyiceberg's scan
(what Python users read with) and pyarrow reading the scan plan's data files minus the rows its
position delete files name. Both must equal the expected rows exactly: no key missing, none
twice, none stale, no deleted row back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import tomli_w
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.config import config_from_dict
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import produce
from icefloe_spark.pipeline import Pipeline
from tests.test_e2e_spark import (
    FAULT_BACKEND,
    SOURCE_OPTIONS,
    WAIT_S,
    crash_after_publishing_batch_1,
    new_topic,
    pipeline_dict,
    run_driver_until,
    wait_until,
)

UPSERTS, CHANGES = "e2e.upserts", "e2e.changes"
KEYS = 40  # few keys, many changes: every key changes several times
ROW_SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "v", LongType(), required=False),
    NestedField(3, "name", StringType(), required=False),
    identifier_field_ids=[1],
)
Rows = dict[int, tuple[int, str]]  # id -> (v, name)


def make_tables(catalog_properties: dict[str, str]) -> Catalog:
    catalog = load_catalog("e2e", **catalog_properties)
    catalog.create_namespace("e2e")
    for name in (UPSERTS, CHANGES):
        catalog.create_table(name, schema=ROW_SCHEMA, properties={"format-version": "2"})
    return catalog


def change_stream(first: int, n: int) -> list[tuple[bytes, dict[str, Any]]]:
    """``n`` changes numbered from ``first``: for the upsert table a new version of key
    ``i % KEYS``; for the CDC table Debezium events of the same key, where every other round
    of the keys deletes those divisible by 4 (the next round inserts them again), and a delete
    of a key never inserted."""
    out: list[tuple[bytes, dict[str, Any]]] = []
    for i in range(first, first + n):
        key = i % KEYS
        row = {"id": key, "v": i, "name": f"n{i}"}
        out.append((str(key).encode(), {"kind": "u", **row}))
        if (i // KEYS) % 2 == 1 and key % 4 == 0:
            op: dict[str, Any] = {"op": "d", "before": {"id": key}, "after": None}
        else:
            op = {"op": "c" if i < KEYS else "u", "before": None, "after": row}
        out.append((str(key).encode(), {"kind": "c", **op}))
    ghost = 10_000 + first  # deleting what was never there changes nothing
    out.append((str(ghost).encode(), {"kind": "c", "op": "d", "before": {"id": ghost}}))
    return out


def expected(changes: Iterable[tuple[bytes, dict[str, Any]]], kind: str) -> Rows:
    """The final rows: the last change per key wins (one key, one partition: produce order)."""
    rows: Rows = {}
    for _, c in changes:
        if c["kind"] != kind:
            continue
        if kind == "u":
            rows[c["id"]] = (c["v"], c["name"])
        elif c["op"] == "d":
            rows.pop(c["before"]["id"], None)
        else:
            rows[c["after"]["id"]] = (c["after"]["v"], c["after"]["name"])
    return rows


def send(bootstrap: str, topic: str, changes: list[tuple[bytes, dict[str, Any]]]) -> None:
    produce(bootstrap, topic, ((k, json.dumps(v).encode()) for k, v in changes))


def as_rows(table: pa.Table) -> Rows:
    """id -> (second column, third column); a key twice fails."""
    ids, vs, names = (table.column(i).to_pylist() for i in range(3))
    rows = dict(zip(ids, zip(vs, names, strict=True), strict=True))
    assert len(rows) == len(ids), f"duplicate keys: {sorted(ids)}"
    return rows


def scanned(catalog: Catalog, name: str) -> Rows:
    """pyiceberg's own read (it applies position deletes)."""
    return as_rows(catalog.load_table(name).scan().to_arrow().select(["id", "v", "name"]))


def read_by_hand(
    catalog: Catalog, name: str, columns: tuple[str, str, str] = ("id", "v", "name")
) -> Rows:
    """Data files minus the (file_path, pos) pairs of their position delete files, with
    pyarrow alone: the Iceberg spec's reading of a row delta, not pyiceberg's."""
    parts = []
    for task in catalog.load_table(name).scan().plan_files():
        data = pq.read_table(task.file.file_path.removeprefix("file://"))
        gone: set[int] = set()
        for delete in task.delete_files:
            d = pq.read_table(delete.file_path.removeprefix("file://"))
            mine = pc.equal(d["file_path"], task.file.file_path)
            gone.update(d.filter(mine)["pos"].to_pylist())
        keep = [i not in gone for i in range(data.num_rows)]
        parts.append(data.filter(pa.array(keep, pa.bool_())).select(list(columns)))
    return as_rows(pa.concat_tables(parts)) if parts else {}


def assert_state(catalog: Catalog, want: dict[str, Rows]) -> None:
    for name, rows in want.items():
        assert scanned(catalog, name) == rows, f"{name}: pyiceberg's scan"
        assert read_by_hand(catalog, name) == rows, f"{name}: data files minus deletes"


def upsert_pipeline(
    broker: EmbeddedKafkaBroker, topic: str, props: dict[str, str], ckpt: Path, batch: int
) -> dict[str, Any]:
    data = pipeline_dict(
        f"e2e-upsert-{uuid.uuid4().hex[:10]}", broker, topic, props, FAULT_BACKEND, ckpt, batch
    )
    data["tables"] = [
        {
            "name": UPSERTS,
            "route_field": "kind",
            "route_values": ["u"],
            "mode": "upsert",
            "id_columns": ["id"],
        },
        {
            "name": CHANGES,
            "route_field": "kind",
            "route_values": ["c"],
            "mode": "cdc",
            "id_columns": ["id"],
        },
    ]
    return data


def matches(catalog: Catalog, want: dict[str, Rows]) -> bool:
    return all(scanned(catalog, name) == rows for name, rows in want.items())


def test_upsert_and_cdc_tables_hold_exactly_the_final_state(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """Several micro-batches and cycles, keys repeating within and across them, on two
    partitions: after each round the tables equal the final state so far."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_tables(catalog_properties)
    data = upsert_pipeline(kafka_broker, topic, catalog_properties, tmp_path / "ckpt", 70)
    produced: list[tuple[bytes, dict[str, Any]]] = []
    with Pipeline(config_from_dict(data), spark=spark, source_extra_options=SOURCE_OPTIONS):
        for first in (0, 130, 260):
            batch = change_stream(first, 130)
            produced += batch
            send(bootstrap, topic, batch)
            want = {UPSERTS: expected(produced, "u"), CHANGES: expected(produced, "c")}
            wait_until(partial(matches, catalog, want), WAIT_S, f"changes up to {first + 130}")
            assert_state(catalog, want)
    assert len(want[CHANGES]) < KEYS  # some keys end deleted
    tasks = catalog.load_table(CHANGES).scan().plan_files()
    assert any(t.delete_files for t in tasks), "no position deletes: no row delta was tested"


def test_a_replayed_batch_neither_deletes_twice_nor_resurrects_rows(
    kafka_broker: EmbeddedKafkaBroker, catalog_properties: dict[str, str], tmp_path: Path
) -> None:
    """``icefloe run`` dies right after publishing batch 1, before Spark records it; the
    restarted driver runs batch 1 again and publishes it under the same key. The tables must
    equal the final state: the replay is dropped, not applied a second time."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_tables(catalog_properties)
    ckpt = tmp_path / "ckpt"
    data = upsert_pipeline(kafka_broker, topic, catalog_properties, ckpt, 60)
    config_file = tmp_path / "pipeline.toml"
    config_file.write_text(tomli_w.dumps(data))
    produced = change_stream(0, 200)
    send(bootstrap, topic, produced)
    log = tmp_path / "driver.log"
    crash_after_publishing_batch_1(config_file, log, ckpt, WAIT_S)
    more = change_stream(200, 100)  # changes after the crash touch the same keys
    produced += more
    send(bootstrap, topic, more)
    want = {UPSERTS: expected(produced, "u"), CHANGES: expected(produced, "c")}
    run_driver_until(
        config_file, log, lambda: matches(catalog, want), 2 * WAIT_S, "the final state"
    )
    assert (ckpt / "commits" / "1").exists()
    assert_state(catalog, want)


def test_demo_cdc_command_ends_with_the_exact_final_state(tmp_path: Path) -> None:
    """``icefloe demo --cdc`` as a user runs it (small): exit 0, its own check passes, and the
    table read by hand equals the final state of the change stream it produced."""
    from icefloe_spark.cli.demo_cdc import TABLE, Changes, change

    records = 3000
    command = ["demo", "--cdc", "--dir", str(tmp_path), "--records", str(records)]
    proc = subprocess.run(
        [sys.executable, "-m", "icefloe", *command],
        capture_output=True,
        text=True,
        timeout=2 * WAIT_S,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "exact final state" in out
    customers = Changes(records).customers
    want: Rows = {}
    for i in range(records):
        c = change(i, customers)
        if c["op"] == "d":
            want.pop(c["before"]["id"], None)
        else:
            want[c["after"]["id"]] = (c["after"]["version"], c["after"]["name"])
    catalog = load_catalog("demo", **{"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}"})
    got = read_by_hand(catalog, TABLE, ("id", "version", "name"))
    assert got == want
    assert 0 < len(want) < customers  # some customers end deleted
