"""What one Spark write task does with its rows, free of Spark so it can be tested alone.

The rows arrive in Spark's Kafka column layout as Arrow. Everything stays columnar: values are
decoded a whole batch at a time by the codec, routed and conformed as Arrow tables, and written
by pyiceberg's Parquet writer (per-record Python objects would cost most of the throughput).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.table import Table

from icefloe.convert import RecordConverter
from icefloe.datafiles import write_data_files
from icefloe.errors import ConfigError
from icefloe.events import DataFileMeta, SourcePosition

REQUIRED_COLUMNS = ("value", "topic", "partition", "offset")
"""Spark's Kafka layout columns the sink needs (key, timestamp, headers are optional)."""


@dataclass(frozen=True)
class TaskOutput:
    """The files one task wrote, per table, and how far it got in each source partition."""

    files: dict[str, tuple[DataFileMeta, ...]] = field(default_factory=dict)
    table_uuids: dict[str, str] = field(default_factory=dict)
    positions: tuple[SourcePosition, ...] = ()
    records: int = 0


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


def write_task(
    data: pa.Table,
    tables: Mapping[str, Table],
    converter: RecordConverter,
    *,
    on_file: Callable[[str], None] | None = None,
) -> TaskOutput:
    """Decode, route, conform and write one task's rows; commit nothing.

    ``on_file`` hears of every file as soon as it exists, so a failing task can remove what it
    wrote.
    """
    check_columns(data.column_names)
    positions = source_positions(data)
    if data.num_rows == 0:
        return TaskOutput(positions=positions)
    files: dict[str, tuple[DataFileMeta, ...]] = {}
    uuids: dict[str, str] = {}
    for name, rows in converter.convert(data).items():
        if rows.num_rows == 0:
            continue
        table = tables[name]
        metas = write_data_files(table, rows)
        for m in metas:
            if on_file is not None:
                on_file(m.path)
        if metas:
            files[name] = tuple(metas)
            uuids[name] = str(table.metadata.table_uuid)
    return TaskOutput(files=files, table_uuids=uuids, positions=positions, records=data.num_rows)
