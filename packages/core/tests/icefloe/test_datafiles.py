"""Data files: written by a writer, carried in a DataWritten event, committed without opening
them, and read back. Real catalog (SQLite), real Parquet files."""

from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import replace
from decimal import Decimal
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.manifest import DataFile
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform, DayTransform, IdentityTransform
from pyiceberg.types import (
    DecimalType,
    DoubleType,
    LongType,
    NestedField,
    StringType,
    TimestampType,
    UUIDType,
)

from icefloe.events import (
    DataFileMeta,
    DataWritten,
    Event,
    FileContent,
    WriterRef,
    decode_event,
    encode_event,
)
from icefloe.records.datafiles import to_data_file, write_data_files

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=False),
    NestedField(2, "region", StringType(), required=False),
    NestedField(3, "ts", TimestampType(), required=False),
    NestedField(4, "amount", DecimalType(10, 2), required=False),
    NestedField(5, "uid", UUIDType(), required=False),
    NestedField(6, "score", DoubleType(), required=False),
)
# identity on a string and on a decimal, a day transform, and a bucket of a uuid (pyiceberg's
# writer cannot group by an identity uuid: Arrow has no hash kernel for its uuid type)
SPEC = PartitionSpec(
    PartitionField(2, 1000, IdentityTransform(), "region"),
    PartitionField(3, 1001, DayTransform(), "ts_day"),
    PartitionField(4, 1002, IdentityTransform(), "amount"),
    PartitionField(5, 1003, BucketTransform(4), "uid_bucket"),
)
UIDS = [uuid.UUID(int=i * 0x1234_5678_9ABC_DEF0) for i in range(1, 4)]


def _rows() -> list[dict[str, Any]]:
    rows = []
    for i in range(60):
        rows.append(
            {
                "id": i,
                "region": None if i % 10 == 9 else ("eu", "us")[i % 2],
                "ts": datetime.datetime(2024, 3, 1 + i % 3, i % 24, 30),
                "amount": (Decimal("1.50"), Decimal("20.25"), None)[i % 3],
                "uid": UIDS[i % 3].bytes,
                "score": float("nan") if i == 7 else i / 4,
            }
        )
    return rows


@pytest.fixture
def table(sqlite_catalog: Catalog) -> Table:
    sqlite_catalog.create_namespace("shop")
    return sqlite_catalog.create_table("shop.sales", schema=SCHEMA, partition_spec=SPEC)


def _data() -> pa.Table:
    return pa.Table.from_pylist(_rows(), schema=schema_to_pyarrow(SCHEMA))


def _through_the_channel(table: Table, metas: list[DataFileMeta]) -> list[DataFileMeta]:
    event = Event(
        "shop-pipeline",
        DataWritten("shop.sales", tuple(metas), table_uuid=str(table.metadata.table_uuid)),
        writer=WriterRef("writer-1", 1),
        batch_seq=0,
    )
    decoded = decode_event(encode_event(event))
    assert decoded == event
    assert isinstance(decoded.payload, DataWritten)
    return list(decoded.payload.files)


def _committed_files(table: Table) -> dict[str, DataFile]:
    return {t.file.file_path: t.file for t in table.scan().plan_files()}


def _fast_append(table: Table, files: list[DataFile]) -> Table:
    with table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        for f in files:
            append.append_data_file(f)
    return table


def test_written_files_round_trip_through_an_event_and_commit(table: Table) -> None:
    data = _data()
    metas = write_data_files(table, data)
    assert len(metas) > 4  # several partitions, so several files
    assert table.current_snapshot() is None  # writers never commit
    for m in metas:
        local = urlparse(m.path).path
        assert m.path.startswith(table.location())
        assert os.path.getsize(local) == m.file_size_in_bytes
        assert pq.ParquetFile(local).metadata.num_rows == m.record_count
        assert m.content is FileContent.DATA
        assert m.spec_id == table.metadata.default_spec_id
    assert sum(m.record_count for m in metas) == data.num_rows

    decoded = _through_the_channel(table, metas)
    files = [to_data_file(m, table.metadata) for m in decoded]
    _fast_append(table, files)

    table = table.refresh()
    got = table.scan().to_arrow().sort_by("id")
    assert got.num_rows == data.num_rows
    assert got.drop_columns(["score"]).equals(data.sort_by("id").drop_columns(["score"]))
    scores = got.column("score").to_pylist()
    assert [s for i, s in enumerate(scores) if i != 7] == [i / 4 for i in range(60) if i != 7]
    assert scores[7] != scores[7]  # NaN

    committed = _committed_files(table)
    assert set(committed) == {m.path for m in metas}
    for m in metas:
        f = committed[m.path]
        assert f.record_count == m.record_count
        assert f.file_size_in_bytes == m.file_size_in_bytes
        assert f.column_sizes == m.column_sizes
        assert f.value_counts == m.value_counts
        assert f.null_value_counts == m.null_value_counts
        assert f.nan_value_counts == m.nan_value_counts
        assert f.lower_bounds == m.lower_bounds
        assert f.upper_bounds == m.upper_bounds
        assert list(f.split_offsets or []) == list(m.split_offsets or [])
        # partition values come back typed by the spec (decimal as Decimal, day as int)
        assert [f.partition[i] for i in range(4)] == [
            None if p.value is None else Decimal(p.value) if p.name == "amount" else p.value  # type: ignore[arg-type]
            for p in m.partition
        ]


def test_partition_values_of_each_kind_are_carried(table: Table) -> None:
    metas = _through_the_channel(table, write_data_files(table, _data()))
    by_name: dict[str, set[Any]] = {}
    for m in metas:
        assert [p.field_id for p in m.partition] == [1000, 1001, 1002, 1003]
        for p in m.partition:
            by_name.setdefault(p.name, set()).add(p.value)
    assert by_name["region"] == {"eu", "us", None}
    march_1 = (datetime.date(2024, 3, 1) - datetime.date(1970, 1, 1)).days
    assert by_name["ts_day"] == {march_1, march_1 + 1, march_1 + 2}
    assert by_name["amount"] == {"1.50", "20.25", None}
    assert by_name["uid_bucket"] <= {0, 1, 2, 3}
    assert {type(to_data_file(m, table.metadata).partition[2]) for m in metas} == {
        Decimal,
        type(None),
    }


def test_committed_stats_and_partitions_prune_scans(table: Table) -> None:
    metas = write_data_files(table, _data())
    _fast_append(
        table, [to_data_file(m, table.metadata) for m in _through_the_channel(table, metas)]
    )
    table = table.refresh()
    eu = table.scan(row_filter="region == 'eu'")
    assert 0 < len(list(eu.plan_files())) < len(metas)
    assert sorted(eu.to_arrow().column("id").to_pylist()) == [
        i for i in range(60) if i % 2 == 0 and i % 10 != 9
    ]
    high = table.scan(row_filter="id >= 55")  # pruned by the id column's bounds
    assert len(list(high.plan_files())) < len(metas)
    assert sorted(high.to_arrow().column("id").to_pylist()) == list(range(55, 60))


def test_unknown_spec_is_refused(table: Table) -> None:
    meta = write_data_files(table, _data())[0]
    with pytest.raises(ValueError, match="partition spec 7"):
        to_data_file(replace(meta, spec_id=7), table.metadata)


def test_no_rows_no_files(table: Table) -> None:
    assert write_data_files(table, _data().slice(0, 0)) == []
