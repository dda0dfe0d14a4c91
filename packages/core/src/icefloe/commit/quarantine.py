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

The coordinator's writes are fenced like its table commits: a new leader raises its fence
(:meth:`Quarantine.fence`: its token as a table property, with an empty snapshot that moves
``main``) before it reads anything, and :meth:`Quarantine.add` and :meth:`Quarantine.retire`
with a token refuse (:class:`~icefloe.errors.StaleFencingTokenError`) when a newer one is
recorded; a write planned before the fence fails the catalog's check of ``main``. Why: a
deposed leader's entry that its heir's view of the quarantine misses lets the heir commit
the same file (the simulation, seed 25004: rows in the table and in quarantine).

An entry also records the source offsets its batch reached (``source_offsets``): a rollback's
replay reads a source range again and retires the entries of the batches inside it
(:func:`icefloe.commit.rollback.replays`), which channel offsets cannot tell across a backend
swap. Columns added since the table's first release are optional and added to an existing
table by its next write, so older tables, readers and writers keep working.

The same table keeps, as table properties, the tables whose commits keep failing
(:class:`FailingTable`: ``coordination.quarantine_after_failures`` failures in a row with an
error that quarantines nothing), so ``icefloe status`` can report them from any process.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression, EqualTo, In, Reference
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.types import (
    IntegerType,
    ListType,
    LongType,
    NestedField,
    StringType,
    StructType,
    TimestamptzType,
)

from icefloe.commit.versions import without_retries
from icefloe.errors import StaleFencingTokenError

if TYPE_CHECKING:  # Arrow loads to write or read entries, not to find there are none
    import pyarrow as pa

DEFAULT_QUARANTINE_TABLE = "icefloe.quarantine"
RETIRED = "Retired"
"""``error_type`` of a retired entry: its file's records came back otherwise (a rollback's
replay read them again). Kept as a tombstone, not deleted: the same file announced again
(under any writer id) must not be quarantined or committed a second time, so the coordinator
still knows its path; :meth:`Quarantine.list` leaves it out (nothing to recover) and
``icefloe maintain`` may delete the file."""
# a table property of the quarantine table per failing table: icefloe.failing.<group>/<table>
# (pipeline names may hold dots, never a slash)
_FAILING_PREFIX = "icefloe.failing."
_MAX_ERROR_CHARS = 2000  # a property, not a log: the start of a long message says enough
# a table property of the quarantine table per pipeline: its newest leader's fencing token
_FENCE_PREFIX = "icefloe.fence."
_FENCE_SUMMARY_KEY = "icefloe.fence"  # in the summary of the empty snapshot that raised it
_LAST = 9  # a fenced write's last attempt: commits that lost a race are planned again

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
    # added after the first release: optional, and added to an existing table by its next write
    NestedField(
        15,
        "source_offsets",
        ListType(
            16,
            StructType(
                NestedField(17, "topic", StringType(), required=True),
                NestedField(18, "partition", IntegerType(), required=True),
                NestedField(19, "offset", LongType(), required=True),
            ),
            element_required=True,
        ),
        required=False,
    ),
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
    source_offsets: Mapping[str, Mapping[int, int]] | None = None
    """Where the file's batch reached in the source (topic -> partition -> next offset, from its
    DataComplete): what a rollback's replay range is compared with, whatever channel the batch
    came through. None when not known: an entry written before icefloe recorded it, or a batch
    that reports no source position (a rollback's own replay)."""


_FIELDS = tuple(f.name for f in _SCHEMA.fields)
_SOURCE_OFFSETS = "source_offsets"


@dataclass(frozen=True)
class FailingTable:
    """A table whose commits failed ``coordination.quarantine_after_failures`` times in a row,
    as the coordinator recorded it when that happened: what ``icefloe status`` reports."""

    failures: int
    error: str  # "<exception type>: <message>" of the failure that raised the alarm
    since_ms: int  # when the first of the failures in a row happened
    marked_ms: int  # when the alarm was recorded (a later commit of the table clears it)


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

    def _writable(self) -> Table:
        """The table, created or given the columns added since it was created (optional ones:
        readers of either schema, and older writers that leave them out, keep working)."""
        t = self._table(create=True)
        assert t is not None
        have = {f.name for f in t.schema().fields}
        if have.issuperset(_FIELDS):
            return t
        try:
            with t.update_schema() as update:
                update.union_by_name(_SCHEMA)
        except CommitFailedException:
            t = self._catalog.load_table(self.identifier)  # another writer added them first
            if not {f.name for f in t.schema().fields}.issuperset(_FIELDS):
                raise
        return t

    def paths(self, group_id: str, table_name: str) -> set[str]:
        """Paths of ``table_name``'s files quarantined by ``group_id``."""
        t = self._table(create=False)
        return _paths(t, group_id, table_name) if t is not None and _holds_rows(t) else set()

    def all_paths(self) -> set[str]:
        """Paths of every quarantined file, of every pipeline and table: files that
        ``icefloe maintain`` must never delete as orphans (the entry promises them back).
        Retired entries promise nothing: their files may go."""
        t = self._table(create=False)
        if t is None or not _holds_rows(t):
            return set()
        rows = t.scan(selected_fields=("file_path", "error_type")).to_arrow().to_pylist()
        return {r["file_path"] for r in rows if r["error_type"] != RETIRED}

    def add(
        self,
        entries: Sequence[QuarantineEntry],
        token: int | None = None,
        channel_id: str | None = None,
    ) -> list[QuarantineEntry]:
        """Record ``entries`` (one append), skipping files already recorded; returns the new.

        With the writing leader's fencing ``token`` (issued by channel ``channel_id``): fenced
        (:meth:`fence`), raises :class:`~icefloe.errors.StaleFencingTokenError` when a newer
        leader of the entries' pipeline raised its fence, and writes nothing."""
        if not entries:
            return []
        groups = {e.group_id for e in entries}

        def attempt() -> list[QuarantineEntry]:
            t = self._writable()
            if token is not None:
                t = self._fenced(t, groups, token, channel_id)
            new = _unknown(t, entries)
            if new:
                t.append(_to_arrow(t, new))
            return new

        return _planned_again(attempt, token is not None)

    def fence(self, group_id: str, token: int, channel_id: str | None = None) -> None:
        """Record ``token`` as the newest leader's of ``group_id`` (issued by ``channel_id``),
        before that leader reads anything: from then on a write with an older token (a deposed
        leader's, :meth:`add` and :meth:`retire` with their token) is refused, so every entry
        an older leader wrote is one the new leader reads.

        How: one commit that sets the token (a table property, ``icefloe.fence.<group>``)
        and adds an empty snapshot, so the table's ``main`` moves: a write planned on an
        older version, its token checked there, fails the catalog's check of ``main`` and
        is planned again, where it finds the new token. Raises
        :class:`~icefloe.errors.StaleFencingTokenError` when a newer token of the same
        channel is recorded; tokens of another channel (a drained one, whose leaders were
        stopped) fence nothing here, as on the pipeline's tables."""

        def attempt() -> None:
            t = without_retries(self._writable())
            recorded = _recorded_fence(t, group_id)
            _check_fence(self.identifier, group_id, recorded, token, channel_id)
            if recorded == _Fence(token, channel_id):
                return  # raised already (an earlier attempt's commit landed)
            value = json.dumps({"token": token, "channel_id": channel_id})
            with t.transaction() as tx:
                tx.set_properties({_fence_key(group_id): value})
                summary = {_FENCE_SUMMARY_KEY: f"{group_id}:{token}"}
                with tx.update_snapshot(snapshot_properties=summary).fast_append():
                    pass  # empty: what counts is that main moves

        _planned_again(attempt, True)

    def _fenced(
        self, table: Table, groups: Iterable[str], token: int, channel_id: str | None
    ) -> Table:
        """``table`` with pyiceberg's retries off (a retry must check the fence again), once
        no pipeline of ``groups`` records a newer token than ``token``."""
        for group_id in groups:
            recorded = _recorded_fence(table, group_id)
            _check_fence(self.identifier, group_id, recorded, token, channel_id)
        return without_retries(table)

    def list(
        self, group_id: str, table_name: str | None = None, retired: bool = False
    ) -> list[QuarantineEntry]:
        """Entries of ``group_id`` (optionally one table), oldest first; ``retired``: with the
        retired ones (:data:`RETIRED`), which hold nothing to recover."""
        t = self._table(create=False)
        if t is None or not _holds_rows(t):  # none: no scan (and no Arrow) needed
            return []
        rows = t.scan(row_filter=_filter(group_id, table_name)).to_arrow().to_pylist()
        entries = [_from_row(r) for r in rows]
        if not retired:
            entries = [e for e in entries if e.error_type != RETIRED]
        return sorted(entries, key=lambda e: (e.quarantined_at, e.table_name, e.file_path))

    def mark_failing(self, group_id: str, table_name: str, failing: FailingTable) -> None:
        """Record that ``table_name`` keeps failing (a property of the quarantine table, so
        ``icefloe status`` sees it from any process, for any backend, even for a table that
        cannot be loaded)."""
        t = self._table(create=True)
        assert t is not None
        record = asdict(failing)
        record["error"] = failing.error[:_MAX_ERROR_CHARS]
        with t.transaction() as tx:
            tx.set_properties({_failing_key(group_id, table_name): json.dumps(record)})

    def clear_failing(self, group_id: str, table_name: str) -> None:
        """Forget the failing mark of ``table_name`` (it committed again)."""
        t = self._table(create=False)
        key = _failing_key(group_id, table_name)
        if t is not None and key in t.metadata.properties:
            with t.transaction() as tx:
                tx.remove_properties(key)

    def failing(self, group_id: str) -> dict[str, FailingTable]:
        """The failing marks of ``group_id``, per table."""
        t = self._table(create=False)
        if t is None:
            return {}
        prefix = _failing_key(group_id, "")
        return {
            key[len(prefix) :]: FailingTable(**json.loads(raw))
            for key, raw in t.metadata.properties.items()
            if key.startswith(prefix)
        }

    def retire(
        self,
        group_id: str,
        table_name: str,
        paths: Iterable[str],
        why: str = "",
        token: int | None = None,
        channel_id: str | None = None,
    ) -> int:
        """Mark the entries of ``paths`` retired (:data:`RETIRED`: files whose records came
        back otherwise, e.g. with a rollback's replay, as ``why`` says), in one snapshot that
        replaces them; returns how many there were. Why not delete them: the simulation found
        a retired file announced again under a new writer id, quarantined a second time while
        the replay had committed its records. With a fencing ``token``: fenced as :meth:`add`."""
        wanted = set(paths)
        if not wanted:
            return 0

        def attempt() -> int:
            t = self._table(create=False)
            if t is None:
                return 0
            if token is not None:
                t = self._fenced(self._writable(), [group_id], token, channel_id)
            # pyiceberg 0.12's expression classes declare a pydantic __init__ that mypy mis-reads
            listed = In(Reference("file_path"), wanted)  # type: ignore[call-arg,arg-type]
            where = And(_filter(group_id, table_name), listed)
            matched = [_from_row(r) for r in t.scan(row_filter=where).to_arrow().to_pylist()]
            count = sum(e.error_type != RETIRED for e in matched)
            if not count:
                return 0
            message = f"retired: {why or 'its records came back otherwise'}"[:_MAX_ERROR_CHARS]
            # the overwrite replaces every matched row: earlier tombstones are written back
            tombstones = [
                e
                if e.error_type == RETIRED
                else replace(e, error_type=RETIRED, error_message=message)
                for e in matched
            ]
            if token is None:
                t = self._writable()
            t.overwrite(_to_arrow(t, tombstones), overwrite_filter=where)
            return count

        return _planned_again(attempt, token is not None)

    def drop(
        self, group_id: str, table_name: str | None = None, file_path: str | None = None
    ) -> int:
        """Delete (acknowledge) matching entries; returns how many there were."""
        where = _filter(group_id, table_name)
        if file_path is not None:
            where = And(where, _eq("file_path", file_path))
        return self._delete(where)

    def _delete(self, where: BooleanExpression) -> int:
        t = self._table(create=False)
        if t is None:
            return 0
        count = len(t.scan(row_filter=where, selected_fields=("file_path",)).to_arrow())
        if count:
            t.delete(delete_filter=where)
        return count


@dataclass(frozen=True)
class _Fence:
    """The newest leader's fencing token of a pipeline, and the channel that issued it."""

    token: int
    channel_id: str | None


def _holds_rows(table: Table | None) -> bool:
    """Whether ``table`` may hold entries, told by its head's summary without a scan (which
    loads Arrow: ``icefloe status`` stays light). The fences' empty snapshots hold none."""
    snapshot = None if table is None else table.current_snapshot()
    if snapshot is None:
        return False
    summary = snapshot.summary
    return summary is None or summary.get("total-records") != "0"


_T = TypeVar("_T")


def _planned_again(attempt: Callable[[], _T], fenced: bool) -> _T:
    """``attempt()``, planned and committed again while its commit loses a race to another
    (a fenced write checks the fence again each time), ``_LAST`` times at most. Unfenced, the
    first ``CommitFailedException`` is raised."""
    for n in range(_LAST + 1):
        try:
            return attempt()
        except CommitFailedException:
            if not fenced or n == _LAST:
                raise
    raise AssertionError("unreachable")


def _fence_key(group_id: str) -> str:
    return f"{_FENCE_PREFIX}{group_id}"


def _recorded_fence(table: Table, group_id: str) -> _Fence | None:
    raw = table.metadata.properties.get(_fence_key(group_id))
    if raw is None:
        return None
    value = json.loads(raw)
    return _Fence(int(value["token"]), value.get("channel_id"))


def _check_fence(
    where: str, group_id: str, recorded: _Fence | None, token: int, channel_id: str | None
) -> None:
    """Raise when ``recorded`` is a newer token than ``token`` of the same channel."""
    if recorded is not None and recorded.channel_id == channel_id and recorded.token > token:
        raise StaleFencingTokenError(
            f"quarantine table '{where}' records fencing token {recorded.token} for group "
            f"'{group_id}', above this coordinator's {token}: a newer coordinator has taken over"
        )


def _unknown(table: Table, entries: Sequence[QuarantineEntry]) -> list[QuarantineEntry]:
    """``entries`` whose files ``table`` does not record yet (for their pipeline and table)."""
    known: dict[tuple[str, str], set[str]] = {}
    new: list[QuarantineEntry] = []
    for e in entries:
        key = (e.group_id, e.table_name)
        if key not in known:
            known[key] = _paths(table, *key)
        if e.file_path not in known[key]:
            known[key].add(e.file_path)
            new.append(e)
    return new


def _paths(table: Table, group_id: str, table_name: str) -> set[str]:
    scan = table.scan(row_filter=_filter(group_id, table_name), selected_fields=("file_path",))
    return set(scan.to_arrow().column("file_path").to_pylist())


def _failing_key(group_id: str, table_name: str) -> str:
    return f"{_FAILING_PREFIX}{group_id}/{table_name}"


def _filter(group_id: str, table_name: str | None) -> BooleanExpression:
    where: BooleanExpression = And(AlwaysTrue(), _eq("group_id", group_id))
    if table_name is not None:
        where = And(where, _eq("table_name", table_name))
    return where


def _eq(column: str, value: str) -> BooleanExpression:
    # pyiceberg 0.12's expression classes declare a pydantic __init__ that mypy mis-reads
    return EqualTo(Reference(column), value)  # type: ignore[call-arg,arg-type]


def _to_arrow(table: Table, entries: Iterable[QuarantineEntry]) -> pa.Table:
    import pyarrow as pa

    # the table's own schema: an upgraded table numbers the added columns its own way
    rows = [_to_row(e) for e in entries]
    return pa.Table.from_pylist(rows, schema=table.schema().as_arrow())


def _to_row(entry: QuarantineEntry) -> dict[str, Any]:
    row = {k: getattr(entry, k) for k in _FIELDS}
    if entry.source_offsets is not None:
        row[_SOURCE_OFFSETS] = [
            {"topic": topic, "partition": partition, "offset": offset}
            for topic, parts in sorted(entry.source_offsets.items())
            for partition, offset in sorted(parts.items())
        ]
    return row


def _from_row(row: Mapping[str, Any]) -> QuarantineEntry:
    """An entry from a scanned row; a table without the later columns reads as None there."""
    values: dict[str, Any] = {k: row.get(k) for k in _FIELDS}
    listed = values.pop(_SOURCE_OFFSETS)
    offsets: dict[str, dict[int, int]] | None = None
    if listed:  # a null list may read back empty
        offsets = {}
        for p in listed:
            offsets.setdefault(p["topic"], {})[p["partition"]] = p["offset"]
    return QuarantineEntry(**values, source_offsets=offsets)
