"""The branch a table is committed to: its head, its history, and how it comes to exist.

A branch that does not exist yet is created in the same transaction as the first append,
from the table's current snapshot (as Iceberg's Java ``toBranch`` does). Catalogs refuse to
create a non-main branch on a table without snapshots, so on an empty table an empty,
unreferenced root snapshot (summary ``icefloe.branch-root``) comes first to fork it from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

from pyiceberg.manifest import ManifestContent, ManifestEntryStatus
from pyiceberg.serializers import FromInputFile
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from icefloe.commit.request import table_name
from icefloe.commit.summary import BRANCH_ROOT_KEY
from icefloe.errors import CommitError

DELETES = ManifestContent.DELETES


def branch_head(table: Table, branch: str) -> tuple[Snapshot | None, int | None]:
    """The branch's head, and the snapshot to fork it from when it does not exist yet."""
    metadata = table.metadata
    ref = metadata.refs.get(branch)
    if ref is not None:
        if ref.snapshot_ref_type != SnapshotRefType.BRANCH:
            raise CommitError(
                f"table '{table_name(table)}': '{branch}' is a tag, not a branch; "
                "set the table's branch (or coordination.branch) to a branch name"
            )
        return metadata.snapshot_by_id(ref.snapshot_id), None
    if branch == MAIN_BRANCH:
        return None, None
    base = metadata.current_snapshot() or _root(metadata, branch)
    return base, None if base is None else base.snapshot_id


def history(head: Snapshot | None, metadata: TableMetadata) -> set[int]:
    """Ids of ``head`` and its ancestors still in the table."""
    return {s.snapshot_id for s in ancestors_of(head, metadata)}


def added_files(table: Table, snapshot: Snapshot) -> tuple[set[str], set[str]]:
    """Paths of the data files and of the delete files ``snapshot`` added (its manifests'
    entries added by it).

    Why: a descendant of ``snapshot`` still references those it did not delete, and a
    snapshot that does not descend from it (a rollback below it) references none of them, so
    they tell the two apart where the parent links between were expired. Delete files count
    too: a batch of an upsert/CDC table that only deletes adds no data file."""
    added: dict[ManifestContent, set[str]] = {ManifestContent.DATA: set(), DELETES: set()}
    for m in snapshot.manifests(table.io):
        if m.added_snapshot_id == snapshot.snapshot_id:
            added[m.content] |= {
                e.data_file.file_path
                for e in m.fetch_manifest_entry(table.io, discard_deleted=True)
                if e.status == ManifestEntryStatus.ADDED and e.snapshot_id == snapshot.snapshot_id
            }
    return added[ManifestContent.DATA], added[DELETES]


def live_delete_files(table: Table, head: Snapshot | None) -> set[str]:
    """Paths of the delete files ``head`` references (read only where the walk down a branch
    stops at an expired snapshot, see :func:`added_files`)."""
    if head is None:
        return set()
    return {
        e.data_file.file_path
        for m in head.manifests(table.io)
        if m.content == DELETES
        for e in m.fetch_manifest_entry(table.io, discard_deleted=True)
    }


@dataclass(frozen=True)
class Line:
    """The history of a branch head as far as it reaches, told against a snapshot ``target``
    that is not in it (the group's newest, which the table property keeps).

    Sequence numbers grow along every line of descent, so a line reaching a snapshot older
    than ``target`` without passing it never descended from it (the branch was moved off it:
    a rollback), while a line that begins after it (its oldest snapshot lost its parent to
    expiry) may descend from it."""

    oldest: Snapshot | None
    target: int

    def descends(self, sequence: int | None) -> bool | None:
        """True or False where the line itself tells (``sequence``: the target's sequence
        number, None when unknown); None where it cannot."""
        if self.oldest is None:
            return False  # no branch head: nothing of the target is left
        if self.oldest.parent_snapshot_id == self.target:
            return True  # the expired parent it names (Iceberg Java keeps the dangling id)
        number = self.oldest.sequence_number
        if sequence and number and number < sequence:
            return False
        return None

    def after(self, sequence: int | None) -> bool:
        """Whether the line begins after the target (its oldest snapshot is newer)."""
        number = None if self.oldest is None else self.oldest.sequence_number
        return bool(sequence and number and number > sequence)


def ancestors_in_log(table: Table, oldest: Snapshot | None) -> Iterator[Snapshot]:
    """The ancestors of ``oldest`` (the oldest snapshot a branch's walk reaches) that the
    current metadata no longer links, newest first, as the table's earlier metadata files
    (the metadata log, newest first) still hold them: one written before an expiry holds the
    expired snapshots and their parent links. Ends where no file reaches further back (deleted
    by ``write.metadata.delete-after-commit``, or the log begins after them).

    Why: an expiry can leave nothing in the current metadata that links a head to the
    pipeline's snapshot while both exist (another engine's rewrite expired alone; pyiceberg's
    expiry also clears the parent id), which is what a rollback onto another line looks like
    too. Read only where the current metadata cannot tell."""
    if oldest is None:
        return
    current = oldest.snapshot_id
    for entry in reversed(table.metadata.metadata_log):
        try:
            earlier = FromInputFile.table_metadata(table.io.new_input(entry.metadata_file))
        except Exception:  # deleted or unreadable: an older file may still tell
            continue
        start = earlier.snapshot_by_id(current)
        if start is None:
            return  # written before that snapshot: older files do not know it either
        for snapshot in islice(ancestors_of(start, earlier), 1, None):
            yield snapshot
            current = snapshot.snapshot_id


def told_by_log(
    table: Table, oldest: Snapshot | None, target: int, sequence: int | None
) -> bool | None:
    """Whether the line ending at ``oldest`` descends from the snapshot ``target``, told by
    :func:`ancestors_in_log`: True where the walk there reaches ``target``, False where it
    reaches a snapshot older than it (``sequence``: its sequence number) without passing it,
    None where it ends first."""
    for snapshot in ancestors_in_log(table, oldest):
        if snapshot.snapshot_id == target:
            return True
        number = snapshot.sequence_number
        if sequence and number and number < sequence:
            return False
    return None


def oldest_of(head: Snapshot | None, metadata: TableMetadata) -> Snapshot | None:
    """The oldest snapshot the walk down from ``head`` reaches in ``metadata``."""
    last = deque(ancestors_of(head, metadata), maxlen=1)
    return last[0] if last else None


def line(head: Snapshot | None, metadata: TableMetadata, target: int) -> Line:
    """The :class:`Line` of ``head`` told against the snapshot ``target``."""
    return Line(oldest_of(head, metadata), target)


def needs_root(table: Table, branch: str) -> bool:
    """Whether ``branch`` can only be created after :func:`commit_root`."""
    metadata = table.metadata
    return (
        branch != MAIN_BRANCH
        and branch not in metadata.refs
        and metadata.current_snapshot() is None
        and _root(metadata, branch) is None
    )


def commit_root(table: Table, branch: str) -> None:
    """Add an empty snapshot that no ref points to yet, to fork ``branch`` from."""
    tx = table.transaction()
    root = {BRANCH_ROOT_KEY: branch}
    with tx.update_snapshot(snapshot_properties=root, branch=None).fast_append():
        pass
    tx.commit_transaction()


def _root(metadata: TableMetadata, branch: str) -> Snapshot | None:
    """The newest empty root snapshot made for ``branch``, if any."""
    roots = [
        s
        for s in metadata.snapshots
        if s.summary is not None and s.summary[BRANCH_ROOT_KEY] == branch
    ]
    return max(roots, key=lambda s: s.sequence_number or 0, default=None)
