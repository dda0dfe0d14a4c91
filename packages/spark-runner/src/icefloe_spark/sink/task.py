"""What one Spark write task does with its rows, free of Spark so it can be tested alone.

The rows arrive in Spark's Kafka column layout as Arrow. Everything stays columnar: values are
decoded a whole batch at a time by the codec, routed and conformed as Arrow tables, and written
by pyiceberg's Parquet writer (per-record Python objects would cost most of the throughput).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from icefloe.errors import ConfigError, RecordConversionError
from icefloe.events import DataFileMeta, SourcePosition

if TYPE_CHECKING:
    from pyiceberg.table import Table

    from icefloe.config import ErrorsConfig
    from icefloe.records.converter import RecordConverter, Rejected

REQUIRED_COLUMNS = ("value", "topic", "partition", "offset")
"""Spark's Kafka layout columns the sink needs (key, timestamp, headers are optional)."""


@dataclass(frozen=True)
class TaskOutput:
    """The files one task wrote, per table, and how far it got in each source partition."""

    files: dict[str, tuple[DataFileMeta, ...]] = field(default_factory=dict)
    table_uuids: dict[str, str] = field(default_factory=dict)
    positions: tuple[SourcePosition, ...] = ()
    records: int = 0
    skipped: int = 0  # bad records dropped under policy "skip"
    dead_lettered: int = 0  # bad records written to the dead-letter table
    # with ``only`` (a replay): why the bad records meant for that table or for none failed
    unplaced: tuple[RecordConversionError, ...] = ()


def check_columns(names: Sequence[str]) -> None:
    """Fail early, naming what is missing, when the input is not in Spark's Kafka layout."""
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise ConfigError(
            "sink input",
            f"the streaming DataFrame lacks column(s) {', '.join(missing)}",
            "write a DataFrame with Spark's Kafka layout "
            "(key, value, topic, partition, offset, timestamp, ...)",
            list(names),
        )


def source_positions(data: pa.Table) -> tuple[SourcePosition, ...]:
    """Per (topic, partition): the next offset after the highest one seen and the newest
    record timestamp in epoch milliseconds."""
    if data.num_rows == 0:
        return ()
    cols: dict[str, pa.ChunkedArray] = {
        "topic": data["topic"],
        "partition": data["partition"],
        "offset": data["offset"],
    }
    aggs = [("offset", "max")]
    if "timestamp" in data.column_names:
        ts = data["timestamp"]
        if pa.types.is_timestamp(ts.type):
            ts = pc.cast(ts, pa.timestamp("ms", tz=ts.type.tz), safe=False)
        cols["ts"] = pc.cast(ts, pa.int64(), safe=False)
        aggs.append(("ts", "max"))
    grouped = pa.table(cols).group_by(["topic", "partition"]).aggregate(aggs).to_pylist()
    return tuple(
        sorted(
            (
                SourcePosition(
                    topic=str(g["topic"]),
                    partition=int(g["partition"]),
                    offset=int(g["offset_max"]) + 1,
                    max_timestamp_ms=None if g.get("ts_max") is None else int(g["ts_max"]),
                )
                for g in grouped
            ),
            key=lambda p: (p.topic, p.partition),
        )
    )


FAIL_FIX = (
    'to keep the pipeline going past bad records, set [errors] policy = "skip" or '
    'policy = "dead_letter" (with dead_letter_table) in the pipeline config'
)


def write_task(
    data: pa.Table,
    tables: Mapping[str, Table],
    converter: RecordConverter,
    *,
    on_file: Callable[[str], None] | None = None,
    errors: ErrorsConfig | None = None,
    pipeline: str = "",
    only: str | None = None,
) -> TaskOutput:
    """Decode, route, conform and write one task's rows; commit nothing.

    A bad record fails the task under ``errors.policy = "fail"`` (the error names it and the
    fix); otherwise only the bad records are set aside, counted, and under ``dead_letter``
    written as data files of the dead-letter table (in ``tables``), published with the batch's
    other files so they are committed exactly once with them. An upsert/CDC table gets the
    final row image per key as data files and the keys its records touched as a key file
    (content ``EQUALITY_DELETES``, ``equality_ids`` its identifier fields), which the
    coordinator resolves into deletes of the rows they replace. ``on_file`` hears of every file as
    soon as it exists, so a failing task can remove what it wrote. ``only`` writes the rows of
    that one table and nothing else (a rollback's replay: the other tables hold their share
    already): bad records only when it names the dead-letter table.
    """
    from icefloe.records.datafiles import group_write_uuid, write_data_files, write_key_files

    policy = errors.policy if errors is not None else "fail"
    check_columns(data.column_names)
    positions = source_positions(data)
    if data.num_rows == 0:
        return TaskOutput(positions=positions)
    if policy == "fail":
        try:
            conversion = converter.convert_batch(data)
        except RecordConversionError as exc:
            raise exc.with_(fix=FAIL_FIX) from None
    else:
        conversion = converter.convert_tolerant(data)
    rows_per_table = dict(conversion.tables)
    if only is not None:
        rows_per_table = {t: rows for t, rows in rows_per_table.items() if t == only}
    rejected = conversion.rejected
    if (
        rejected
        and policy == "dead_letter"
        and errors is not None
        and errors.dead_letter_table
        and only in (None, errors.dead_letter_table)
    ):
        rows_per_table[errors.dead_letter_table] = dead_letter_rows(data, rejected, pipeline)
    files: dict[str, tuple[DataFileMeta, ...]] = {}
    uuids: dict[str, str] = {}
    for name, rows in rows_per_table.items():
        keys = conversion.keys.get(name)
        if rows.num_rows == 0 and (keys is None or keys.num_rows == 0):
            continue
        table = tables[name]
        # named for the pipeline, so merge_small_files may delete them once merged, and the
        # committer the key files once applied
        metas = write_data_files(table, rows, group_write_uuid(pipeline) if pipeline else None)
        if keys is not None:  # an upsert/CDC table: the keys whose old rows go (docs/upsert.md)
            metas += write_key_files(table, keys, group_write_uuid(pipeline) if pipeline else None)
        for m in metas:
            if on_file is not None:
                on_file(m.path)
        if metas:
            files[name] = tuple(metas)
            uuids[name] = str(table.metadata.table_uuid)
    bad = len(rejected)
    return TaskOutput(
        files=files,
        table_uuids=uuids,
        positions=positions,
        records=data.num_rows,
        skipped=bad if policy == "skip" else 0,
        dead_lettered=bad if policy == "dead_letter" else 0,
        unplaced=()
        if only is None
        else tuple(r.error for r in rejected if r.error.table in (None, only)),
    )


def dead_letter_rows(
    data: pa.Table, rejected: Sequence[Rejected], pipeline: str, now: dt.datetime | None = None
) -> pa.Table:
    """The rejected records of ``data`` (Spark's Kafka layout) as rows of the dead-letter
    table: where each came from, its raw key and value, and why it was set aside."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    from icefloe_spark.sink.tables import DEAD_LETTER_SCHEMA

    target = schema_to_pyarrow(DEAD_LETTER_SCHEMA)
    picked = data.take(pa.array([r.row for r in rejected], pa.int64()))
    n = picked.num_rows
    failed_at = now or dt.datetime.now(dt.UTC)

    def col(name: str) -> pa.Array | pa.ChunkedArray:
        kind = target.field(name).type
        if name not in picked.column_names:
            return pa.nulls(n, kind)
        return pc.cast(picked[name], kind)

    columns = {
        "pipeline": pa.array([pipeline] * n, pa.string()),
        "topic": col("topic"),
        "partition": col("partition"),
        "offset": col("offset"),
        "timestamp": col("timestamp"),
        "key": col("key"),
        "value": col("value"),
        "target_table": pa.array([r.error.table for r in rejected], pa.string()),
        "error_type": pa.array([r.error.kind for r in rejected], pa.string()),
        "error_message": pa.array([str(r.error) for r in rejected], pa.string()),
        "failed_at": pa.array([failed_at] * n, target.field("failed_at").type),
    }
    return pa.Table.from_arrays([columns[f.name] for f in target], schema=target)
