"""Quarantine: the durable record of announced files the coordinator will not commit.

A file is quarantined when its table refuses it for good (a
:class:`~icefloe.errors.RefusedFileError`: wrong table incarnation, outside the table location,
old partition spec, delete file, undescribable) or when its table keeps failing with a
:class:`~icefloe.errors.PermanentTableError` (missing, history lost). The record lets the
channel position advance past the file (so one bad event never blocks a table or, through
retention, loses later data) without the file disappearing silently.

Where it lives, and why: an Iceberg table in the pipeline's own catalog (default
``icefloe.quarantine``, one row per pipeline, table and file path). The catalog is the one
store every deployment has whatever the coordination backend (Kafka, PostgreSQL, Redis or a
third party's), it survives coordinator restarts, it works for tables that no longer exist,
and operators can query it with any Iceberg engine. The coordinator writes the record
*before* committing the rest of the table and before storing the channel position, so a crash
in between re-reads the event, finds the record and neither loses nor re-quarantines it
(rows are keyed by pipeline, table and path). Operators list and drop entries with
``icefloe quarantine``.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression, EqualTo, Reference
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.types import LongType, NestedField, StringType, TimestamptzType

DEFAULT_QUARANTINE_TABLE = "icefloe.quarantine"

log = logging.getLogger("icefloe.quarantine")

_SCHEMA = Schema(
    NestedField(1, "group_id", StringType(), required=True),
    NestedField(2, "table_name", StringType(), required=True),
    NestedField(3, "file_path", StringType(), required=True),
    NestedField(4, "record_count", LongType(), required=True),
    NestedField(5, "file_size_in_bytes", LongType(), required=True),
    NestedField(6, "writer_id", StringType(), required=True),
    NestedField(7, "batch_seq", LongType(), required=True),
    NestedField(8, "channel_partition", StringType(), required=True),
    NestedField(9, "channel_offset", LongType(), required=True),
    NestedField(10, "table_uuid", StringType(), required=False),
    NestedField(11, "error_type", StringType(), required=True),
    NestedField(12, "error_message", StringType(), required=True),
    NestedField(13, "commit_id", StringType(), required=True),
    NestedField(14, "quarantined_at", TimestamptzType(), required=True),
)


@dataclass(frozen=True)
class QuarantineEntry:
    """One quarantined file: where it was announced and why it was refused."""

    group_id: str
    table_name: str
    file_path: str
    record_count: int
    file_size_in_bytes: int
    writer_id: str
    batch_seq: int
    channel_partition: str
    channel_offset: int
    table_uuid: str | None
    error_type: str
    error_message: str
    commit_id: str
    quarantined_at: dt.datetime


_FIELDS = tuple(f.name for f in _SCHEMA.fields)


class Quarantine:
    """The quarantine table of one catalog; entries of every pipeline, filtered by group."""

    def __init__(self, catalog: Catalog, identifier: str = DEFAULT_QUARANTINE_TABLE) -> None:
        self._catalog = catalog
        self.identifier = identifier

    def _table(self, create: bool) -> Table | None:
        try:
            return self._catalog.load_table(self.identifier)
        except NoSuchTableError:
            if not create:
                return None
        namespace = self.identifier.rsplit(".", 1)[0]
        self._catalog.create_namespace_if_not_exists(namespace)
        return self._catalog.create_table_if_not_exists(self.identifier, _SCHEMA)

    def paths(self, group_id: str, table_name: str) -> set[str]:
        """Paths of ``table_name``'s files quarantined by ``group_id``."""
        t = self._table(create=False)
        if t is None:
            return set()
        scan = t.scan(row_filter=_filter(group_id, table_name), selected_fields=("file_path",))
        return set(scan.to_arrow().column("file_path").to_pylist())

    def all_paths(self) -> set[str]:
        """Paths of every quarantined file, of every pipeline and table: files that
        ``icefloe maintain`` must never delete as orphans (the entry promises them back)."""
        t = self._table(create=False)
        if t is None:
            return set()
        scan = t.scan(selected_fields=("file_path",))
        return set(scan.to_arrow().column("file_path").to_pylist())

    def add(self, entries: Sequence[QuarantineEntry]) -> list[QuarantineEntry]:
        """Record ``entries`` (one append), skipping files already recorded; returns the new."""
        if not entries:
            return []
        t = self._table(create=True)
        assert t is not None
        known: dict[tuple[str, str], set[str]] = {}
        new: list[QuarantineEntry] = []
        for e in entries:
            key = (e.group_id, e.table_name)
            if key not in known:
                known[key] = self.paths(*key)
            if e.file_path not in known[key]:
                known[key].add(e.file_path)
                new.append(e)
        if new:
            t.append(_to_arrow(new))
        return new

    def list(self, group_id: str, table_name: str | None = None) -> list[QuarantineEntry]:
        """Entries of ``group_id`` (optionally one table), oldest first."""
        t = self._table(create=False)
        if t is None:
            return []
        rows = t.scan(row_filter=_filter(group_id, table_name)).to_arrow().to_pylist()
        entries = [QuarantineEntry(**{k: r[k] for k in _FIELDS}) for r in rows]
        return sorted(entries, key=lambda e: (e.quarantined_at, e.table_name, e.file_path))

    def drop(
        self, group_id: str, table_name: str | None = None, file_path: str | None = None
    ) -> int:
        """Delete (acknowledge) matching entries; returns how many there were."""
        t = self._table(create=False)
        if t is None:
            return 0
        where = _filter(group_id, table_name)
        if file_path is not None:
            where = And(where, _eq("file_path", file_path))
        count = len(t.scan(row_filter=where, selected_fields=("file_path",)).to_arrow())
        if count:
            t.delete(delete_filter=where)
        return count


def _filter(group_id: str, table_name: str | None) -> BooleanExpression:
    where: BooleanExpression = And(AlwaysTrue(), _eq("group_id", group_id))
    if table_name is not None:
        where = And(where, _eq("table_name", table_name))
    return where


def _eq(column: str, value: str) -> BooleanExpression:
    # pyiceberg 0.12's expression classes declare a pydantic __init__ that mypy mis-reads
    return EqualTo(Reference(column), value)  # type: ignore[call-arg,arg-type]


def _to_arrow(entries: Iterable[QuarantineEntry]) -> pa.Table:
    rows = [{k: getattr(e, k) for k in _FIELDS} for e in entries]
    return pa.Table.from_pylist(rows, schema=_SCHEMA.as_arrow())
