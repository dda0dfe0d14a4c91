"""The applied-files record (:class:`~icefloe.commit.dedupe.Applied`): files the pipeline
applied, or a rollback took out, that no snapshot of the branch names, so the dedupe rule can
hold them by path whatever writer id announces them again.

* **Key files**: an upsert/CDC batch's key file is resolved into position deletes and never
  committed itself. Announced again under another writer id (the watermarks do not cover it,
  and the branch head does not name it), it would delete the rows written since. Each commit
  that applies key files lists them (:func:`with_applied_keys`); once it landed, the committer
  deletes those the pipeline provably owns (named for it, as its Spark sink names them:
  :mod:`icefloe.commit.ownership`), and the next commit drops them from the list.
* **Rolled-back files**: ``icefloe rollback`` moves the branch below data files the pipeline
  committed. Whether the range is replayed (the replay writes new files) or not (the rows stay
  out), the old files must not come back when announced again: the rollback lists the data
  files it takes out (:func:`with_rolled_back`) in the state the pipeline goes on from.
* **Rewritten files**: a data file the pipeline committed that a rewrite took off the branch
  (its own compaction's ``replace``, another engine's rewrite or delete) is found in that
  snapshot while it is retained; once the pipeline commits above it, ``icefloe maintain``
  may expire it, and nothing would tell the file was committed. So each commit lists the data
  files removed since the pipeline's previous commit (:func:`with_removed`).

Bounded: a key file that no longer exists needs no entry (announced again, screening
quarantines it as missing), so the pipeline's own key files stay listed for one commit. Other
writers' key files (not named for the pipeline) are never deleted by the committer: each time
key files are added, the oldest listed ones are looked up in storage and those gone are dropped
(``icefloe maintain`` deletes applied key files as orphans once older than its retention).
Rolled-back files are listed once per rollback. Rewritten files stay listed while they are in
storage (about the snapshot retention: ``icefloe maintain`` deletes them as orphans once their
removal expired); each commit that lists new ones looks up as many listed ones again, round the
list, and drops those gone.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace

from pyiceberg.table import Table
from pyiceberg.utils.concurrent import ExecutorFactory

from icefloe.commit.dedupe import Applied, CommitBoundary, encode_applied
from icefloe.commit.retirement import side_file

# Oldest key-file entries looked up per commit that adds entries, besides two per new entry:
# the list shrinks as fast as it grows once `icefloe maintain` deletes old key files.
PRUNE_CHECKS = 16

SideFile = tuple[str, bytes]  # location, content


def with_applied_keys(
    table: Table, boundary: CommitBoundary, keys: Iterable[str], deleted: Collection[str]
) -> tuple[CommitBoundary, SideFile | None]:
    """``boundary`` listing the key files ``keys`` (applied by the commit it is for), and the
    side file to write first when the list changed. Dropped on the way: entries in
    ``deleted`` (what this committer deleted after its previous commit) and, when entries are
    added, the oldest entries whose files are gone."""
    applied = boundary.applied
    new = tuple(dict.fromkeys(k for k in keys if k not in applied))
    earlier = tuple(p for p in applied.keys if p not in deleted)
    if new:
        gone = _gone(table, earlier[: PRUNE_CHECKS + 2 * len(new)])
        earlier = tuple(p for p in earlier if p not in gone)
    if earlier + new == applied.keys:
        return boundary, None
    return _listed(table, boundary, replace(applied, keys=earlier + new))


def with_rolled_back(
    table: Table, boundary: CommitBoundary, paths: Iterable[str]
) -> tuple[CommitBoundary, SideFile | None]:
    """``boundary`` listing the data files ``paths`` a rollback takes out of the branch, and
    the side file to write first when the list changed."""
    retired = boundary.applied.retired.union(paths)
    if retired == boundary.applied.retired:
        return boundary, None
    return _listed(table, boundary, replace(boundary.applied, retired=retired))


def with_removed(
    table: Table, boundary: CommitBoundary, paths: Iterable[str]
) -> tuple[CommitBoundary, SideFile | None]:
    """``boundary`` listing the data files ``paths`` (those the snapshots since the pipeline's
    previous commit took off the branch), and the side file to write first when the list
    changed. Adding entries looks up the next ``PRUNE_CHECKS`` and two per new entry: those
    gone from storage are dropped, the others move to the end of the list.

    Why here, in the commit, and not in the compaction round or ``icefloe maintain``: the
    commit is atomic and reads only the table. A round that dies before its ``replace`` landed
    removed nothing; one that dies after it, or a coordinator that dies before any bookkeeping,
    leaves the ``replace`` in the history, where the next commit of any coordinator finds it,
    and ``icefloe maintain`` keeps it until then (the chain down to the pipeline's newest
    snapshot, :func:`icefloe.ops.maintenance.dedupe_snapshots`). Keeping the ``replace``
    snapshots instead would keep their originals referenced, never deleted, and the history
    with them: unbounded over months of rounds; this list only holds files still in storage.
    """
    removed = boundary.applied.removed
    new = sorted(set(paths).difference(removed))
    if not new:
        return boundary, None
    checked = removed[: PRUNE_CHECKS + 2 * len(new)]
    gone = _gone(table, checked)
    kept = removed[len(checked) :] + tuple(p for p in checked if p not in gone)
    return _listed(table, boundary, replace(boundary.applied, removed=kept + tuple(new)))


def _gone(table: Table, paths: Sequence[str]) -> set[str]:
    """Which of ``paths`` are gone from storage (looked up in parallel)."""
    executor = ExecutorFactory.get_or_create()
    found = executor.map(lambda p: table.io.new_input(p).exists(), paths)
    return {p for p, exists in zip(paths, found, strict=True) if not exists}


def _listed(
    table: Table, boundary: CommitBoundary, applied: Applied
) -> tuple[CommitBoundary, SideFile]:
    location, content = side_file(table, "applied", encode_applied(applied))
    return replace(boundary, applied=applied, applied_file=location), (location, content)
