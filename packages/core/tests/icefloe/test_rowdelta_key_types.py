"""Upsert and delete by key for every Iceberg type allowed as an identifier field, through the
real committer on a real SQLite catalog, read back by pyiceberg's scan (position deletes
applied): unpartitioned, partitioned by the key itself (identity) and by ``bucket(key)`` (what
docs/upsert.md recommends), so the pruning by partition values and bounds is exercised too."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg import types as it
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform, IdentityTransform, Transform

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.records.changes import DELETE_FLAG, key_arrow_schema, last_per_key
from icefloe.records.datafiles import write_data_files, write_key_files

GROUP = "pipe-types"
NAME = "db.keyed"
_EPOCH = dt.datetime(2024, 5, 1, 12, 0)

# per identifier type: the i-th distinct key value
KEYS: dict[str, tuple[it.PrimitiveType, Callable[[int], Any]]] = {
    "int": (it.IntegerType(), lambda i: i - 2),
    "long": (it.LongType(), lambda i: 2**40 + i),
    "string": (it.StringType(), lambda i: f"key-{i:03d}"),
    "uuid": (it.UUIDType(), lambda i: uuid.UUID(int=(i + 1) * 2**100 + i)),
    "date": (it.DateType(), lambda i: dt.date(2024, 2, 27) + dt.timedelta(days=i)),
    "time": (it.TimeType(), lambda i: dt.time(8, 0, i, 250)),
    "timestamp": (it.TimestampType(), lambda i: _EPOCH + dt.timedelta(seconds=i, microseconds=7)),
    "timestamptz": (
        it.TimestamptzType(),
        lambda i: (_EPOCH + dt.timedelta(hours=i)).replace(tzinfo=dt.UTC),
    ),
    "decimal": (it.DecimalType(10, 2), lambda i: Decimal(f"{i * 1000 - 1}.25")),
    "fixed": (it.FixedType(4), lambda i: bytes([i, 0, 255, i])),
    "binary": (it.BinaryType(), lambda i: b"\x00k" + bytes([i]) * (i + 1)),
    "boolean": (it.BooleanType(), lambda i: bool(i)),
}
SPECS: dict[str, Transform[Any, Any] | None] = {
    "unpartitioned": None,
    "identity": IdentityTransform(),
    "bucket": BucketTransform(4),
}

# partitioned writes pyiceberg 0.12's writer fails on, keyed or not (docs/upsert.md)
PYICEBERG_CANNOT_WRITE: dict[tuple[str, str], tuple[str, type[Exception]]] = {
    ("uuid", "identity"): (
        "pyiceberg groups rows by partition with pyarrow, which cannot group extension<arrow.uuid>",
        pa.ArrowNotImplementedError,
    ),
    ("time", "bucket"): (
        "pyiceberg's partition path converts the bucket number as a time",
        AttributeError,
    ),
}


class Keyed:
    """A keyed table, the committer, and the model of what it must hold (key -> value)."""

    def __init__(self, catalog: SqlCatalog, key_type: it.PrimitiveType, spec: str) -> None:
        schema = Schema(
            it.NestedField(1, "k", key_type, required=True),
            it.NestedField(2, "v", it.StringType(), required=False),
            identifier_field_ids=[1],
        )
        transform = SPECS[spec]
        partitioning = (
            PartitionSpec()
            if transform is None
            else PartitionSpec(PartitionField(1, 1000, transform, "k_part"))
        )
        self.catalog = catalog
        catalog.create_namespace("db")
        self.table: Table = catalog.create_table(NAME, schema=schema, partition_spec=partitioning)
        self.arrow = schema_to_pyarrow(schema, include_field_ids=False)
        self.committer = IcebergCommitter(catalog, GROUP)
        self.model: dict[Any, str] = {}
        self.offset = 0

    def cycle(self, upserts: dict[Any, str], deletes: list[Any]) -> None:
        """One batch of one writer (its changes reduced to the last per key as a write task
        does), committed in a cycle of its own."""
        table = self.catalog.load_table(NAME)
        key_type = self.arrow.field("k").type
        changes = pa.table(
            {
                "k": pa.array([*upserts, *deletes], key_type),
                DELETE_FLAG: [False] * len(upserts) + [True] * len(deletes),
            }
        )
        images = pa.table([changes["k"][: len(upserts)], list(upserts.values())], self.arrow)
        rows, keys = last_per_key(images, changes)
        metas = write_data_files(table, rows) + write_key_files(table, keys)
        uid = str(table.metadata.table_uuid)
        self.offset += 1
        files = tuple(PendingFile(m, "w", self.offset, "0", self.offset, uid) for m in metas)
        result = self.committer.commit(
            TableCommitRequest(NAME, f"c{self.offset}", files, {"0": self.offset + 1}, {}, 1)
        )
        assert result.snapshot_id is not None
        self.model.update(upserts)
        for k in deletes:
            self.model.pop(k, None)

    def rows(self) -> list[tuple[Any, str]]:
        """The table's rows as pyiceberg's scan reads them (not the committer's code)."""
        scanned = self.catalog.load_table(NAME).scan().to_arrow()
        return sorted(
            zip(scanned.column("k").to_pylist(), scanned.column("v").to_pylist(), strict=True),
            key=repr,
        )


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("key_type", list(KEYS))
def test_upsert_and_delete_by_every_identifier_type(
    sqlite_catalog: SqlCatalog, key_type: str, spec: str, request: pytest.FixtureRequest
) -> None:
    iceberg_type, value = KEYS[key_type]
    if spec == "bucket" and not BucketTransform(4).can_transform(iceberg_type):
        pytest.skip(f"Iceberg has no bucket transform for {key_type}")
    if (key_type, spec) in PYICEBERG_CANNOT_WRITE:
        # strict: once pyiceberg writes these, the test says so
        why, raises = PYICEBERG_CANNOT_WRITE[key_type, spec]
        request.applymarker(pytest.mark.xfail(reason=why, raises=raises, strict=True))
    keys = [value(i) for i in range(2 if key_type == "boolean" else 6)]
    table = Keyed(sqlite_catalog, iceberg_type, spec)

    table.cycle({k: "v0" for k in keys[:-1]}, [])
    table.cycle({keys[-1]: "new", keys[1]: "v1"}, [keys[0]])
    table.cycle({keys[-1]: "v2"}, [keys[2 % len(keys)], keys[0]])  # keys[0]: deleted already

    expected = sorted(table.model.items(), key=repr)
    assert table.rows() == expected
    assert len(expected) == (1 if key_type == "boolean" else 4)


_Key = tuple[str, int]


def test_identifier_fields_nested_in_a_struct_and_partitioned_by_one_of_them(
    sqlite_catalog: SqlCatalog,
) -> None:
    """Iceberg allows identifier fields inside (required) structs: key files hold them in
    their struct, and resolution finds them there by field id and prunes by ``bucket(key.n)``."""
    key_struct = it.StructType(
        it.NestedField(3, "tenant", it.StringType(), required=True),
        it.NestedField(4, "n", it.LongType(), required=True),
        it.NestedField(5, "label", it.StringType(), required=False),  # not part of the key
    )
    schema = Schema(
        it.NestedField(1, "key", key_struct, required=True),
        it.NestedField(2, "v", it.StringType(), required=False),
        identifier_field_ids=[3, 4],
    )
    spec = PartitionSpec(PartitionField(4, 1000, BucketTransform(4), "n_bucket"))
    sqlite_catalog.create_namespace("db")
    sqlite_catalog.create_table(NAME, schema=schema, partition_spec=spec)
    arrow = schema_to_pyarrow(schema, include_field_ids=False)
    committer = IcebergCommitter(sqlite_catalog, GROUP)

    def cycle(seq: int, upserts: dict[_Key, str], deletes: list[_Key]) -> None:
        table = sqlite_catalog.load_table(NAME)
        # as conversion hands them on: the key struct with its identifier fields only
        keys = [{"tenant": t, "n": n} for t, n in [*upserts, *deletes]]
        changes = pa.table(
            [keys, [False] * len(upserts) + [True] * len(deletes)],
            key_arrow_schema(schema, ["key.tenant", "key.n"]),
        )
        structs = [{"tenant": t, "n": n, "label": f"{t}{n}"} for t, n in upserts]
        images = pa.table([structs, list(upserts.values())], arrow)
        rows, distinct = last_per_key(images, changes)
        metas = write_data_files(table, rows) + write_key_files(table, distinct)
        assert {m.equality_ids for m in metas if m.equality_ids} == {(3, 4)}
        uid = str(table.metadata.table_uuid)
        files = tuple(PendingFile(m, "w", seq, "0", seq, uid) for m in metas)
        request = TableCommitRequest(NAME, f"c{seq}", files, {"0": seq + 1}, {}, 1)
        assert committer.commit(request).snapshot_id is not None

    cycle(0, {("a", n): "v0" for n in range(6)} | {("b", 1): "v0"}, [])
    cycle(1, {("a", 1): "v1", ("b", 2): "new"}, [("a", 2), ("b", 1)])
    cycle(2, {("a", 1): "v2"}, [("a", 3), ("a", 2)])

    scanned = sqlite_catalog.load_table(NAME).scan().to_arrow().to_pylist()
    assert sorted((r["key"]["tenant"], r["key"]["n"], r["v"]) for r in scanned) == [
        ("a", 0, "v0"),
        ("a", 1, "v2"),
        ("a", 4, "v0"),
        ("a", 5, "v0"),
        ("b", 2, "new"),
    ]
