"""Compaction: rewrite a partition's data files with their position deletes applied.

Why: every upsert/CDC cycle adds a data file and a position delete file (and a delete
manifest), every append cycle at least one data file; scans and the next cycles' key
resolution read them all. A compaction round reads, per partition that needs it
(:func:`needs`), the data files worth rewriting (those some delete file may target, and small
ones) minus the positions their delete files name (:func:`_live_rows`), sorts the live rows by
the table's identifier columns (so the files' bounds prune key resolution), writes them as
files of about the target size, and commits ONE ``replace`` snapshot per table and round on
the table's branch. That snapshot removes the rewritten data files and every delete file that
can target none of the files left, and merges the remaining delete manifests into one per
spec. Its summary says what was rewritten (:data:`COMPACTED_FILES_KEY` and the others below).

Exactly-once next to the pipeline (docs/upsert.md, "Compaction"):

* The coordinator runs the rounds itself, between its cycles: the table's single writer never
  races its own commits. Another engine's rewrite (or a second coordinator) is caught by the
  catalog: the snapshot asserts the branch head it was planned on, so a compaction planned on
  an older head fails and changes nothing, and a cycle resolved against files a rewrite
  replaced fails the same way and resolves again against the new head.
* The rewrite changes no row, so it carries no icefloe state: the committer skips it like a
  foreign snapshot, and it never raises a fencing token.
* Nothing is deleted from storage here. A ``replace`` snapshot only un-references files; the
  originals stay readable through the older snapshots until ``icefloe maintain`` expires them
  and removes the orphans. New files of a round that failed or crashed are orphans too.
* A data file a rewrite removed was committed: the committer finds it in the ``replace``
  snapshot (:meth:`icefloe.commit.livefiles.LiveFiles.held`, as any removal in the branch's
  history), so the same file announced again (under another writer id) is not committed a
  second time. The pipeline's next commit lists what the ``replace`` removed
  (:func:`icefloe.commit.applied.with_removed`), so that still holds once ``icefloe
  maintain`` expired the ``replace``; nothing of it is recorded here, so a round that dies
  at any point leaves nothing to record but what the table shows.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.manifest import (
    DataFile,
    DataFileContent,
    ManifestContent,
    ManifestEntry,
    ManifestEntryStatus,
    ManifestFile,
)
from pyiceberg.table import FileScanTask, Table
from pyiceberg.table.snapshots import Operation, Snapshot, Summary
from pyiceberg.table.update.snapshot import _OverwriteFiles
from pyiceberg.typedef import EMPTY_DICT

from icefloe.commit import branches
from icefloe.commit.request import table_name
from icefloe.commit.versions import without_retries
from icefloe.config import DEFAULT_TARGET_FILE_SIZE
from icefloe.records.datafiles import DataFileBuilder, group_write_uuid, write_data_files

if TYPE_CHECKING:  # Arrow and the row-delta writer load when a round rewrites something:
    # the committer (and `icefloe status` through it) needs only the thresholds and the
    # rewritten-files record from here
    import pyarrow as pa

log = logging.getLogger("icefloe.compaction")

COMPACTED_FILES_KEY = "icefloe.compacted-files"
"""Summary key: how many data files the replace snapshot rewrote."""
COMPACTED_PARTITIONS_KEY = "icefloe.compacted-partitions"
COMPACTED_DELETE_FILES_KEY = "icefloe.compacted-delete-files"
"""Summary key: how many delete files it dropped (they target no file left)."""
COMPACTED_DELETED_ROWS_KEY = "icefloe.compacted-deleted-rows"
"""Summary key: rows the rewrite left out because position deletes removed them."""
COMPACTED_BY_KEY = "icefloe.compacted-by"
"""Summary key: the pipeline (group id) whose coordinator compacted."""

# a data file below this fraction of the target size counts as small (Iceberg's
# rewrite_data_files uses 75% too)
SMALL_FRACTION = 0.75
MAX_FILE_ROWS = 1_000_000
"""Rows a file written by a round holds at most. Why: pyiceberg 0.12's scan applies a data
file's position deletes batch by batch, each time matching the batch's positions against all
the positions deleted in that file (``is_in`` over them), so a file with deletes costs its
batches times its deleted rows: quadratic in its size once a cycle's random upserts land on
it. Before this cap a 10M-row table compacted into two 5M-row files scanned 5.8x slower with
the next cycle's 1M deletes than before any upsert (docs/benchmarks.md, "Upsert compaction");
files of 1M rows keep that matching small next to reading the batch."""

PartitionKey = tuple[int, tuple[Any, ...]]  # spec id, partition values
_READERS = 8  # files a round reads at once


@dataclass(frozen=True)
class Thresholds:
    """When a partition needs compaction; any one suffices (``compact_*`` table keys)."""

    delete_ratio: float = 0.2
    """Rows deleted by position deletes, over live rows."""
    delete_files: int = 8
    small_files: int = 16
    target_file_size_bytes: int = DEFAULT_TARGET_FILE_SIZE
    max_file_rows: int = MAX_FILE_ROWS
    """Rows per new file at most (:data:`MAX_FILE_ROWS`); a file of at least
    :data:`SMALL_FRACTION` of them is not small, whatever its size."""


@dataclass
class PartitionState:
    """One partition of the branch head: its data files (with the deletes pyiceberg
    applies to each) and its delete files."""

    key: PartitionKey
    tasks: list[FileScanTask] = field(default_factory=list)
    delete_files: dict[str, DataFile] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(t.file.record_count for t in self.tasks)

    @property
    def deleted_rows(self) -> int:
        return sum(d.record_count for d in self.delete_files.values())

    def small(self, thresholds: Thresholds) -> list[FileScanTask]:
        size = thresholds.target_file_size_bytes * SMALL_FRACTION
        rows = thresholds.max_file_rows * SMALL_FRACTION
        return [
            t for t in self.tasks if t.file.file_size_in_bytes < size and t.file.record_count < rows
        ]


@dataclass(frozen=True)
class CompactionResult:
    """What one table's round did (``snapshot_id`` None: nothing committed)."""

    table: str
    snapshot_id: int | None
    partitions: int = 0
    rewritten_files: int = 0
    added_files: int = 0
    dropped_delete_files: int = 0
    deleted_rows: int = 0
    skipped_partitions: int = 0  # needed it, but left for the next round (time budget)

    def describe(self) -> str:
        if self.snapshot_id is None:
            return f"{self.table}: nothing to compact"
        later = f"; {self.skipped_partitions} left for the next round" * bool(
            self.skipped_partitions
        )
        return (
            f"{self.table}: compacted {self.partitions} partition(s): {self.rewritten_files} "
            f"data file(s) into {self.added_files}, {self.dropped_delete_files} delete file(s) "
            f"and {self.deleted_rows} deleted row(s) dropped (snapshot {self.snapshot_id}){later}"
        )


def partitions(table: Table, head: Snapshot | None) -> dict[PartitionKey, PartitionState]:
    """The partitions of ``head``: data files with their deletes, and every live delete file
    (also those that target no live file any more, which a scan plan does not show)."""
    found: dict[PartitionKey, PartitionState] = {}
    if head is None:
        return found

    def state(f: DataFile) -> PartitionState:
        record = f.partition
        key = (f.spec_id or 0, tuple(record[i] for i in range(len(record))))
        return found.setdefault(key, PartitionState(key))

    for task in table.scan(snapshot_id=head.snapshot_id).plan_files():
        state(task.file).tasks.append(task)
    for manifest in head.manifests(table.io):
        if manifest.content != ManifestContent.DELETES:
            continue
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            state(entry.data_file).delete_files[entry.data_file.file_path] = entry.data_file
    return found


def needs(part: PartitionState, thresholds: Thresholds) -> bool:
    """Whether a partition passes one of the thresholds."""
    if not _rewritable(part):
        return False
    if not part.tasks:
        return bool(part.delete_files)  # only dangling delete files: drop them
    live = max(part.rows - part.deleted_rows, 1)
    return (
        part.deleted_rows / live >= thresholds.delete_ratio
        or len(part.delete_files) >= thresholds.delete_files
        or len(part.small(thresholds)) >= thresholds.small_files
    )


def _rewritable(part: PartitionState) -> bool:
    """A partition with equality deletes is never rewritten: a round applies position
    deletes only (as pyiceberg's scan does)."""
    return all(d.content != DataFileContent.EQUALITY_DELETES for d in part.delete_files.values())


def _path_range(delete_file: DataFile) -> tuple[str, str] | None:
    """The data file paths a position delete file can target, from its path bounds."""
    from icefloe.commit.rowdelta import FILE_PATH_FIELD_ID

    lower = (delete_file.lower_bounds or {}).get(FILE_PATH_FIELD_ID)
    upper = (delete_file.upper_bounds or {}).get(FILE_PATH_FIELD_ID)
    if lower is None or upper is None:
        return None
    return lower.decode("utf-8", "replace"), upper.decode("utf-8", "replace")


def _may_target(delete_file: DataFile, path: str) -> bool:
    bounds = _path_range(delete_file)
    if bounds is None:
        return True  # no bounds (or truncated ones): it may target anything in its partition
    low, high = bounds
    # a truncated upper bound is a prefix greater than every path it stands for; the
    # comparison below keeps such a file as "may target", which is the safe side
    return low <= path and (path <= high or path.startswith(high))


@dataclass(frozen=True)
class _Rewrite:
    """One partition's rewrite: what goes, what comes."""

    removed: tuple[DataFile, ...]
    dropped: tuple[DataFile, ...]
    added: tuple[DataFile, ...]
    deleted_rows: int


def plan_rewrite(
    part: PartitionState, thresholds: Thresholds, current_spec: int
) -> tuple[list[FileScanTask], list[DataFile]]:
    """The data files to rewrite (those a delete file may target, and small ones; every one
    of a partition of an older spec than ``current_spec``, whose rows move into the current
    spec's partitions) and the delete files that then target none of the data files left."""
    small = {t.file.file_path for t in part.small(thresholds)}
    deletes = list(part.delete_files.values())
    moving = part.key[0] != current_spec
    chosen = [
        t
        for t in part.tasks
        if moving
        or t.delete_files
        or t.file.file_path in small
        or any(_may_target(d, t.file.file_path) for d in deletes)
    ]
    if len(chosen) == 1 and not chosen[0].delete_files and not deletes and not moving:
        chosen = []  # one small file alone: rewriting it changes nothing
    kept = [t.file.file_path for t in part.tasks if t not in chosen]
    dropped = [d for d in deletes if not any(_may_target(d, p) for p in kept)]
    return chosen, dropped


def _sorted_by_keys(table: Table, rows: pa.Table) -> pa.Table:
    """``rows`` sorted by the identifier columns (unsorted when the table has none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from icefloe.records.changes import comparable_type

    schema = table.schema()
    ids = sorted(schema.identifier_field_ids)
    if not ids or rows.num_rows < 2:
        return rows
    keys = {}
    for i, field_id in enumerate(ids):
        name = schema.find_column_name(field_id)
        if name is None:
            return rows
        top, *inner = name.split(".")
        column = rows.column(top)
        if inner:
            column = pc.struct_field(column, inner)
        keys[f"k{i}"] = column.cast(comparable_type(column.type))
    order = pc.sort_indices(pa.table(keys), sort_keys=[(k, "ascending") for k in keys])
    return rows.take(order)


def rewrite_partition(
    table: Table,
    part: PartitionState,
    thresholds: Thresholds,
    write_uuid: Callable[[], uuid.UUID],
) -> _Rewrite | None:
    """Write the partition's live rows of the files :func:`plan_rewrite` picks as new files
    of about the target size and at most ``thresholds.max_file_rows`` rows, each run of them
    named after a fresh ``write_uuid()`` (nothing committed). None when there is nothing to
    do."""
    chosen, dropped = plan_rewrite(part, thresholds, table.metadata.default_spec_id)
    if not chosen and not dropped:
        return None
    added: list[DataFile] = []
    before = sum(t.file.record_count for t in chosen)
    live_rows = 0
    if chosen:
        rows = _live_rows(table, chosen)
        live_rows = rows.num_rows
        if rows.num_rows:
            build = DataFileBuilder(table.metadata).build
            rows = _sorted_by_keys(table, rows)
            target, most = thresholds.target_file_size_bytes, thresholds.max_file_rows
            for start in range(0, rows.num_rows, most):
                # pyiceberg numbers the files of one call from 0: a fresh name per call
                chunk = rows.slice(start, most)
                added += [build(m) for m in write_data_files(table, chunk, write_uuid(), target)]
    return _Rewrite(
        removed=tuple(t.file for t in chosen),
        dropped=tuple(dropped),
        added=tuple(added),
        deleted_rows=before - live_rows,
    )


def _live_rows(table: Table, tasks: Sequence[FileScanTask]) -> pa.Table:
    """The rows of ``tasks``' files, in the table's current schema, minus the positions their
    delete files name. Each file is read whole by pyiceberg's scan (which projects it onto the
    current schema) and its deleted positions dropped with one mask. Why not let that scan
    apply them: it does so per record batch, matching a range built in Python against all the
    file's deleted positions each time, which took about half of a round at 10M rows
    (docs/benchmarks.md, "1,000 cycles"). Files are read concurrently, as that scan reads
    them (object storage answers each read with a round trip)."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    from pyiceberg.io.pyarrow import ArrowScan

    from icefloe.commit.rowdelta import deleted_mask, positions_by_path

    scan = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue())
    deletes = {d.file_path: d for t in tasks for d in t.delete_files}  # the plan's: by sequence
    for d in deletes.values():
        if d.content != DataFileContent.POSITION_DELETES:
            raise ValueError(f"{d.file_path}: a round applies position deletes only")

    def live(task: FileScanTask) -> pa.Table:
        rows = scan.to_table([FileScanTask(task.file)])
        path = task.file.file_path
        dead = deleted_mask(table.io, path, rows.num_rows, task.delete_files, deleted)
        return rows.filter(pa.array(~dead)) if dead.any() else rows

    # a pool of its own: pyiceberg's scan submits to its shared one, which must not wait on
    # itself. The delete files are read first, so the readers of data files share them
    # without writing to ``deleted``
    with ThreadPoolExecutor(max_workers=_READERS) as pool:
        read = pool.map(lambda d: positions_by_path(table.io, d), deletes.values())
        deleted = dict(zip(deletes, read, strict=True))
        pieces = list(pool.map(live, tasks))
    # as pyiceberg's scan does: files (and an empty one) may differ in large_ types
    return pa.concat_tables(pieces, promote_options="permissive")


class _Replace(_OverwriteFiles):
    """A ``replace`` snapshot: data files removed and added (pyiceberg's overwrite does that),
    plus delete files removed, and the delete manifests merged into one per spec.

    Why a subclass: pyiceberg's overwrite removes data files only and would rewrite a delete
    manifest with its data manifest writer; this keeps pyiceberg's handling of data manifests
    and the branch-head assertion, and writes the delete manifests itself."""

    def __init__(self, *args: Any, dropped: Sequence[DataFile] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dropped = {d.file_path for d in dropped}
        self._dropped_files = list(dropped)

    def _existing_manifests(self) -> list[ManifestFile]:
        data = [m for m in super()._existing_manifests() if m.content == ManifestContent.DATA]
        return data + self._merged_delete_manifests()

    def _merged_delete_manifests(self) -> list[ManifestFile]:
        from icefloe.commit.rowdelta import write_delete_manifest

        head = self._transaction.table_metadata.snapshot_by_name(name=self._target_branch)
        if head is None:
            return []
        by_spec: dict[int, list[ManifestEntry]] = {}
        for manifest in head.manifests(io=self._io):
            if manifest.content != ManifestContent.DELETES:
                continue
            for entry in manifest.fetch_manifest_entry(io=self._io, discard_deleted=True):
                gone = entry.data_file.file_path in self._dropped
                by_spec.setdefault(manifest.partition_spec_id, []).append(
                    ManifestEntry.from_args(
                        status=ManifestEntryStatus.DELETED
                        if gone
                        else ManifestEntryStatus.EXISTING,
                        snapshot_id=self._snapshot_id if gone else entry.snapshot_id,
                        sequence_number=entry.sequence_number,
                        file_sequence_number=entry.file_sequence_number,
                        data_file=entry.data_file,
                    )
                )
        return [
            write_delete_manifest(self, spec_id, entries)
            for spec_id, entries in sorted(by_spec.items())
        ]

    def _summary(self, snapshot_properties: dict[str, str] = EMPTY_DICT) -> Any:
        # the summary collector counts removed delete files by their content: let it see
        # them; pyiceberg 0.12 totals only append/overwrite/delete summaries, so the totals
        # are computed as an overwrite's (they are the same) and the operation set after
        removed = self._deleted_data_files
        self._deleted_data_files = removed | set(self._dropped_files)
        self._operation = Operation.OVERWRITE
        try:
            summary = super()._summary(snapshot_properties)
        finally:
            self._deleted_data_files = removed
            self._operation = Operation.REPLACE
        return Summary(Operation.REPLACE, **summary.additional_properties)


class Compactor:
    """Runs compaction rounds for one pipeline: per table, the partitions that need it, in
    one ``replace`` snapshot, within a time budget per round.

    ``load`` loads a table fresh; ``before_commit`` runs right before the catalog commit (the
    coordinator renews its lease there, so a leader that lost it commits nothing);
    ``after_write`` (tests) runs once the new files are written, before the commit."""

    def __init__(
        self,
        group_id: str,
        load: Callable[[str], Table],
        branch_of: Callable[[str], str],
        before_commit: Callable[[], None] | None = None,
        after_write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._group_id = group_id
        self._load = load
        self._branch_of = branch_of
        self._before_commit = before_commit
        self._after_write = after_write
        self._clock = clock

    def pending(self, name: str, thresholds: Thresholds, force: bool = False) -> int:
        """How many partitions a round would rewrite now (for a dry run)."""
        return len(self._todo(self._load(name), thresholds, force))

    def _todo(self, table: Table, thresholds: Thresholds, force: bool) -> list[PartitionState]:
        """The partitions of the branch head to rewrite, the most in need first."""
        head, fork_from = branches.branch_head(table, self._branch_of(table_name(table)))
        if fork_from is not None or head is None:
            return []  # nothing on the branch yet
        current = table.metadata.default_spec_id
        todo = [
            p
            for p in partitions(table, head).values()
            if needs(p, thresholds) or (force and _worth(p, thresholds, current))
        ]
        todo.sort(key=lambda p: -(p.deleted_rows + len(p.delete_files) + len(p.tasks)))
        return todo

    def compact(
        self,
        name: str,
        thresholds: Thresholds,
        budget_s: float | None = None,
        force: bool = False,
    ) -> CompactionResult:
        """One round for table ``name``: rewrite the partitions that pass ``thresholds`` (with
        ``force`` every one with deletes or small files), the most in need first, starting no
        new partition once ``budget_s`` is spent (at least one per round, so every round makes
        progress), and commit them as one snapshot. A commit conflict (someone committed
        meanwhile) is no error: nothing is committed, and the next round plans again."""
        start = self._clock()
        table = without_retries(self._load(name))
        todo = self._todo(table, thresholds, force)
        rewrites: list[_Rewrite] = []
        skipped = 0
        for part in todo:
            if rewrites and budget_s is not None and self._clock() - start >= budget_s:
                skipped += 1
                continue
            # fresh names per write (pyiceberg numbers files per call), tagged as the
            # pipeline's (icefloe.records.datafiles.written_for)
            rewrite = rewrite_partition(
                table, part, thresholds, lambda: group_write_uuid(self._group_id)
            )
            if rewrite is not None:
                rewrites.append(rewrite)
        if not rewrites:
            return CompactionResult(name, None, skipped_partitions=skipped)
        if self._after_write is not None:
            self._after_write(name)
        result = CompactionResult(
            name,
            None,
            partitions=len(rewrites),
            rewritten_files=sum(len(r.removed) for r in rewrites),
            added_files=sum(len(r.added) for r in rewrites),
            dropped_delete_files=sum(len(r.dropped) for r in rewrites),
            deleted_rows=sum(r.deleted_rows for r in rewrites),
            skipped_partitions=skipped,
        )
        summary = {
            COMPACTED_BY_KEY: self._group_id,
            COMPACTED_FILES_KEY: str(result.rewritten_files),
            COMPACTED_PARTITIONS_KEY: str(result.partitions),
            COMPACTED_DELETE_FILES_KEY: str(result.dropped_delete_files),
            COMPACTED_DELETED_ROWS_KEY: str(result.deleted_rows),
        }
        branch = self._branch_of(name)
        tx = table.transaction()
        producer = _Replace(
            Operation.REPLACE,
            tx,
            table.io,
            snapshot_properties=summary,
            branch=branch,
            dropped=[d for r in rewrites for d in r.dropped],
        )
        with producer:
            for r in rewrites:
                for f in r.removed:
                    producer.delete_data_file(f)
                for f in r.added:
                    producer.append_data_file(f)
        if self._before_commit is not None:
            self._before_commit()
        try:
            tx.commit_transaction()
        except CommitFailedException as exc:
            log.info("%s: compaction not committed, the branch moved meanwhile: %s", name, exc)
            return CompactionResult(name, None, skipped_partitions=len(todo))
        done = replace(result, snapshot_id=producer.snapshot_id)
        log.info("%s", done.describe())
        return done


def _worth(part: PartitionState, thresholds: Thresholds, current_spec: int) -> bool:
    """Whether a forced rewrite of the partition changes anything (one of an older spec
    moves into the current one)."""
    return _rewritable(part) and (
        bool(part.delete_files)
        or len(part.small(thresholds)) > 1
        or (part.key[0] != current_spec and bool(part.tasks))
    )
