"""The branch a table is committed to: its head, its history, and how it comes to exist.

A branch that does not exist yet is created in the same transaction as the first append,
from the table's current snapshot (as Iceberg's Java ``toBranch`` does). Catalogs refuse to
create a non-main branch on a table without snapshots, so on an empty table an empty,
unreferenced root snapshot (summary ``icefloe.branch-root``) comes first to fork it from.
"""

from __future__ import annotations

from pyiceberg.manifest import ManifestContent, ManifestEntryStatus
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from icefloe.commit.request import table_name
from icefloe.commit.summary import BRANCH_ROOT_KEY
from icefloe.errors import CommitError


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


def added_data_files(table: Table, snapshot: Snapshot) -> set[str]:
    """Paths of the data files ``snapshot`` added (its manifests' entries added by it).

    Why: a descendant of ``snapshot`` still references those it did not delete, and a
    snapshot that does not descend from it (a rollback below it) references none of them, so
    they tell the two apart where the parent links between were expired."""
    return {
        e.data_file.file_path
        for m in snapshot.manifests(table.io)
        if m.content == ManifestContent.DATA and m.added_snapshot_id == snapshot.snapshot_id
        for e in m.fetch_manifest_entry(table.io, discard_deleted=True)
        if e.status == ManifestEntryStatus.ADDED and e.snapshot_id == snapshot.snapshot_id
    }


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
