"""Merging a cycle's small data files before the commit (``tables.merge_small_files``).

Why in the coordinator: every Spark write task writes its own file for every partition it
touches, so a partitioned table gets tasks x partitions files per cycle, most of them small.
The coordinator is the one place that sees a cycle's files of a table together, before they
are committed, so it can commit a few files of about the target size instead, without a
later rewrite (a compaction commit that conflicts with the pipeline's own commits).

The rules that keep exactly-once:

* Only data files of append tables. A cycle with key files (upsert/CDC) is never merged:
  keys are resolved into position deletes that name data files and row positions.
* A group is data files of one partition spec and partition, each below the target, in
  channel order, packed up to the target; a group of one file stays as it is. Files are read
  with pyiceberg's own scan, projected onto the table's current schema (so files written under
  an older schema merge too) and written with pyiceberg's writer into the table's location.
* Names come from the commit id, the group's source paths and the run's attempt (a uuid5 as
  pyiceberg's write uuid): a commit retried after a conflict rewrites nothing (the merger
  keeps what it wrote). A run that may overlap another run of the same request (a Spark
  commit task: a speculative copy, or a zombie attempt on an executor declared lost) names its
  attempt, so it never overwrites a merged file the other run committed (with other bytes
  after a schema change, or truncated if killed mid-write). A crashed cycle's merged files,
  and those of a run that did not land, are never committed (a retry is a new cycle, with a
  new commit id, or finds the landed commit) and are orphans for ``icefloe maintain``.
* Only files the pipeline provably owns are merged (:mod:`icefloe.commit.ownership`: named
  for this pipeline, under the table's data location, really data, named by no snapshot of
  any ref). Any other announced file is committed by reference, as announced: nothing is
  copied out of it and it is never deleted.
* The originals are deleted only after the commit landed, and only if still provably owned;
  a crash in between leaves them as orphans. The snapshot summary (positions, watermarks,
  offsets) still comes from the announced files, and it names a side file listing the merged
  originals not yet known to be deleted (:func:`merged_originals`), carried from commit to
  commit while they exist: the dedupe rule holds them by path, so an original announced again
  under another writer id is not committed a second time.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from pyiceberg.expressions import AlwaysTrue
from pyiceberg.table import FileScanTask, Table

from icefloe.commit.dedupe import CommitBoundary, encode_merged
from icefloe.commit.ownership import Ownership
from icefloe.commit.retirement import side_file
from icefloe.events import DataFileMeta, FileContent
from icefloe.records.datafiles import DataFileBuilder, write_data_files

_NAMESPACE = uuid.UUID("6f1c2a5e-3b0d-4e59-9a57-1cefe0a1f10e")  # icefloe merged files


@dataclass(frozen=True)
class Merge:
    """What a commit appends after merging, and the originals it replaces."""

    appended: tuple[DataFileMeta, ...]
    replaced: tuple[str, ...]


def groups(
    files: Sequence[DataFileMeta], target: int
) -> tuple[list[list[DataFileMeta]], list[DataFileMeta]]:
    """The groups worth merging (two files or more, same spec and partition, each file below
    ``target``, packed up to it in the given order), and the files kept as they are."""
    kept: list[DataFileMeta] = []
    open_groups: dict[tuple[object, ...], list[DataFileMeta]] = {}
    done: list[list[DataFileMeta]] = []
    for meta in files:
        if meta.content != FileContent.DATA or meta.file_size_in_bytes >= target:
            kept.append(meta)
            continue
        key = (meta.spec_id, meta.partition)
        group = open_groups.setdefault(key, [])
        if group and sum(m.file_size_in_bytes for m in group) + meta.file_size_in_bytes > target:
            done.append(group)
            group = open_groups[key] = []
        group.append(meta)
    done.extend(open_groups.values())
    kept.extend(m for g in done if len(g) == 1 for m in g)
    return [g for g in done if len(g) > 1], kept


def merged_name(commit_id: str, group: Sequence[DataFileMeta], attempt: str = "") -> uuid.UUID:
    """The write uuid of a group's merged files: the same for the same commit, sources and
    ``attempt`` ("": the only run of the commit, whose names stay as they always were)."""
    # commit ids hold no newline: a first line naming an attempt is no other run's first line
    first = f"{commit_id}\nattempt {attempt}" if attempt else commit_id
    return uuid.uuid5(_NAMESPACE, "\n".join([first, *(m.path for m in group)]))


class SmallFileMerger:
    """Merges one commit request's small files; remembers the files each group was merged
    into, so a commit attempt repeated after a conflict rewrites nothing. ``attempt`` names
    this run of the request when another may run at the same time (see :func:`merged_name`)."""

    def __init__(self, commit_id: str, target_file_size: int, attempt: str = "") -> None:
        self._commit_id = commit_id
        self._target = target_file_size
        self._attempt = attempt
        self._written: dict[uuid.UUID, tuple[DataFileMeta, ...]] = {}

    def merge(self, table: Table, files: Sequence[DataFileMeta], ownership: Ownership) -> Merge:
        """Write the merged files of ``files`` for ``table`` (the version this attempt loaded)
        and return what to append instead of ``files``. Only files ``ownership`` proves the
        pipeline's are merged; the others are appended as they are."""
        from pyiceberg.io.pyarrow import ArrowScan  # Arrow only when something is merged

        candidates, _ = groups(files, self._target)
        owned = ownership.mergeable(table, [m for g in candidates for m in g])
        to_merge, kept = groups([m for m in files if m.path in owned], self._target)
        appended = [m for m in files if m.path not in owned] + kept
        replaced: list[str] = []
        build = DataFileBuilder(table.metadata).build
        for group in to_merge:
            name = merged_name(self._commit_id, group, self._attempt)
            written = self._written.get(name)
            if written is None:
                scan = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue())
                data = scan.to_table([FileScanTask(build(m)) for m in group])
                written = tuple(write_data_files(table, data, name, self._target))
                self._written[name] = written
            appended.extend(written)
            replaced.extend(m.path for m in group)
        return Merge(tuple(appended), tuple(replaced))


def merged_originals(
    table: Table, boundary: CommitBoundary, merge: Merge | None, deleted: Collection[str]
) -> tuple[CommitBoundary, tuple[str, bytes] | None]:
    """``boundary`` listing the merged originals the new snapshot records, and the side file
    to write first when that list changed (location, content).

    The list is this commit's originals plus the earlier ones that may still exist: not in
    ``deleted`` (what this committer saw deleted after the previous commit) and found in
    storage (asked only after a failed delete, a crash or another coordinator's commit). A
    deleted original needs no entry: announced again, it is quarantined as missing.
    """
    earlier = {p for p in boundary.merged if p not in deleted and table.io.new_input(p).exists()}
    listed = frozenset(earlier.union(() if merge is None else merge.replaced))
    if listed == boundary.merged:
        return boundary, None
    if not listed:
        return replace(boundary, merged_file=None, merged=listed), None
    location, content = side_file(table, "merged", encode_merged(listed))
    return replace(boundary, merged_file=location, merged=listed), (location, content)
