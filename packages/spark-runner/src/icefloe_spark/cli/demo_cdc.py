"""``icefloe demo --cdc``: a Debezium-style change stream into a keyed table, checked at the end.

Customers are created, updated many times, deleted and created again; the pipeline runs the
table in ``cdc`` mode (upserts and deletes as one row delta per table per cycle). The summary
compares every row of the table with the final state the changes imply.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.schema import Schema
from pyiceberg.types import DoubleType, LongType, NestedField, StringType
from rich.console import Console
from rich.table import Table as RichTable

from icefloe_spark.cli.demo import TOPIC
from icefloe_spark.kafka.admin import end_offsets

TABLE = "demo.customers"
TIERS = ("bronze", "silver", "gold")
COLUMNS = (
    ("id", LongType()),
    ("name", StringType()),
    ("tier", StringType()),
    ("balance", DoubleType()),
    ("version", LongType()),
)
SCHEMA = Schema(
    *(NestedField(i, name, t, required=name == "id") for i, (name, t) in enumerate(COLUMNS, 1)),
    identifier_field_ids=[1],
)
Row = dict[str, Any]


def change(i: int, customers: int) -> Row:
    """Change ``i`` of the stream, a pure function of ``i``: customer ``i % customers``, in
    its round ``i // customers``. Round 0 creates; later rounds update, except that one round
    in seven deletes the customer (the next round creates it again, as an update would)."""
    key, round_ = i % customers, i // customers
    row = {
        "id": key,
        "name": f"customer-{key}",
        "tier": TIERS[(key + round_) % 3],
        "balance": round(round_ * 10.0 + key % 100, 2),
        "version": round_,
    }
    if round_ == 0:
        return {"op": "c", "before": None, "after": row}
    if (key + round_) % 7 == 3:
        return {"op": "d", "before": {"id": key}, "after": None}
    return {"op": "u", "before": {"id": key}, "after": row}


def final_rows(records: int, customers: int) -> dict[int, Row]:
    """Each customer's row after the first ``records`` changes (absent when deleted)."""
    rows: dict[int, Row] = {}
    for i in range(records):
        c = change(i, customers)
        if c["op"] == "d":
            rows.pop(c["before"]["id"], None)
        else:
            rows[c["after"]["id"]] = c["after"]
    return rows


class Changes:
    """The CDC demo scenario (see :class:`icefloe_spark.cli.demo.Scenario`)."""

    table = TABLE
    command = "icefloe demo --cdc"

    def __init__(self, records: int) -> None:
        self.customers = max(records // 5, 1)  # five changes per customer on average

    def tables(self) -> list[dict[str, Any]]:
        return [{"name": TABLE, "mode": "cdc", "id_columns": ["id"]}]

    def create(self, catalog: Catalog) -> str:
        with contextlib.suppress(Exception):
            catalog.create_namespace("demo")
        catalog.create_table_if_not_exists(TABLE, schema=SCHEMA)
        return f"table {TABLE} (keyed by id, cdc mode, {self.customers:,} customers)"

    def events(self, first: int, count: int, rng: random.Random) -> Iterator[tuple[bytes, bytes]]:
        for i in range(first, first + count):
            c = change(i, self.customers)
            key = str((c["after"] or c["before"])["id"]).encode()  # one customer, one partition
            yield key, json.dumps(c).encode()

    def finished(self, catalog: Catalog, records: int, bootstrap: str) -> bool:
        """Caught up: the table's newest snapshot recorded the topic's end offsets."""
        snap = catalog.load_table(TABLE).current_snapshot()
        if snap is None or snap.summary is None:
            return False
        recorded = json.loads(
            snap.summary.additional_properties.get("icefloe.source-offsets", "{}")
        )
        ends = {str(p): o for p, o in end_offsets(bootstrap, TOPIC).items()}
        return bool(recorded.get(TOPIC) == ends)

    def summarize(self, catalog: Catalog, produced: int, seconds: float, out: Console) -> bool:
        want = final_rows(produced, self.customers)
        table = catalog.load_table(TABLE)
        got = table.scan().to_arrow().to_pylist()
        ids = [r["id"] for r in got]
        by_id = {r["id"]: r for r in got}
        missing = sum(1 for k in want if k not in by_id)
        extra = sum(1 for k in by_id if k not in want)
        stale = sum(1 for k, r in want.items() if k in by_id and by_id[k] != r)
        duplicated = len(ids) - len(by_id)
        deletes = sum(1 for i in range(produced) if change(i, self.customers)["op"] == "d")
        delete_files = {d.file_path for t in table.scan().plan_files() for d in t.delete_files}
        ok = missing == extra == stale == duplicated == 0
        grid = RichTable(title="icefloe demo --cdc summary", show_header=False)
        grid.add_row("changes produced", f"{produced:,} ({deletes:,} deletes)")
        grid.add_row("customers that should exist", f"{len(want):,}")
        grid.add_row("rows in table", f"{len(ids):,}")
        grid.add_row("missing / deleted but present", f"{missing:,} / {extra:,}")
        grid.add_row("stale / duplicated", f"{stale:,} / {duplicated:,}")
        grid.add_row("position delete files", f"{len(delete_files):,}")
        grid.add_row("time", f"{seconds:.1f}s")
        grid.add_row("result", "[green]exact final state[/green]" if ok else "[red]MISMATCH[/red]")
        out.print(grid)
        return ok
