"""Which announced files a branch holds already: those its head references as live data
files, and those a retained snapshot in its history took off it (:meth:`LiveFiles.held`).

Answering that reads the head's data manifests, which grows with the table; manifests never
change once written, so their live paths are cached by location and a running committer
decodes only manifests it has not seen (and not even the ones it wrote itself). Manifest
lists never change either: a snapshot's list is decoded once, not at every check, and so are
the files a snapshot removed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator

from pyiceberg.manifest import ManifestContent, ManifestEntryStatus, ManifestFile
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Operation, Snapshot

from icefloe.commit.caches import SharedCache
from icefloe.commit.screening import canonical_path
from icefloe.commit.summary import GROUP_ID_KEY, of_group

logger = logging.getLogger("icefloe.committer")

# Manifests whose live paths are kept in memory (oldest dropped first).
_MANIFEST_CACHE_SIZE = 4096
# Manifest lists kept decoded (a few per table: the heads just checked and committed).
_LIST_CACHE_SIZE = 4096
# Snapshots whose removed data files are kept (mostly empty: removals are rare).
_REMOVED_CACHE_SIZE = 65536


class LiveFiles:
    """The live data-file paths of manifests (canonical: :func:`canonical_path`), cached by
    manifest location."""

    def __init__(self) -> None:
        # manifest location -> live paths; manifest list -> its manifests
        self._manifest_paths: SharedCache[str, frozenset[str]] = SharedCache(_MANIFEST_CACHE_SIZE)
        self._lists: SharedCache[str, tuple[ManifestFile, ...]] = SharedCache(_LIST_CACHE_SIZE)
        # a snapshot's manifest list -> the data files it removed; a manifest an expired
        # snapshot wrote -> the data files it lists as DELETED (:meth:`_removed_below`)
        self._removed: SharedCache[str, frozenset[str]] = SharedCache(_REMOVED_CACHE_SIZE)

    def remember_list(self, location: str, manifests: tuple[ManifestFile, ...]) -> None:
        """Keep the manifests of a manifest list this committer wrote (not to read it back)."""
        self._lists.put(location, manifests)

    def manifests(self, table: Table, snapshot: Snapshot) -> tuple[ManifestFile, ...]:
        """The manifests of ``snapshot`` (its manifest list, decoded once per location)."""
        location = snapshot.manifest_list
        cached = self._lists.get(location)
        if cached is None:
            cached = tuple(snapshot.manifests(table.io))
            self.remember_list(location, cached)
        return cached

    def live_paths(self, table: Table, head: Snapshot | None, paths: set[str]) -> set[str]:
        """Which of ``paths`` the branch head already references as live data files (under
        any name of the same object: ``s3a://`` is ``s3://``, see
        :func:`~icefloe.commit.screening.canonical_path`).

        Reads the head's data manifests; manifest files never change once written, so each
        one's paths are cached by its location and only new manifests are read per commit.
        """
        if head is None or not paths:
            return set()
        named = {canonical_path(p): p for p in paths}
        wanted = named.keys()
        found: set[str] = set()
        for manifest in self.manifests(table, head):
            if manifest.content == ManifestContent.DATA:
                found |= wanted & self._live_of(table, manifest)
        return {named[p] for p in found}

    def held(self, table: Table, head: Snapshot | None, paths: set[str]) -> set[str]:
        """Which of ``paths`` the branch holds already: live at ``head`` (:meth:`live_paths`),
        or taken off the branch by a retained snapshot in the history of ``head`` (another
        engine's overwrite, delete or rewrite, icefloe's compaction). Such a file was
        committed once, and committing it again, announced under another writer id, would
        bring back its rows twice or rows someone deleted.

        Only snapshots that may remove a data file are read, each once (:func:`_may_remove`):
        the pipeline's own appends and row deltas are skipped, so a cycle walks the history in
        memory and reads only other engines' new removals. A snapshot that removed the file
        is newer than the one that added it, so it outlives it under expiry; once it is
        expired too (or the walk stops at an expired snapshot above it), only a manifest it
        wrote that a retained snapshot still lists tells (:meth:`_removed_below`), and without
        one nothing retained tells that the file was committed (docs/architecture.md,
        invariant 1)."""
        live = self.live_paths(table, head, paths)
        named = {canonical_path(p): p for p in paths - live}
        if head is None or not named:
            return live
        found: set[str] = set()
        oldest = head
        for snapshot in _history(head, table.metadata):
            oldest = snapshot
            if _may_remove(snapshot):
                found |= named.keys() & self._removed_by(table, snapshot)
        found |= named.keys() & self._removed_below(table, oldest)
        return live | {named[p] for p in found}

    def removed_above(self, table: Table, snapshot: Snapshot, base: Collection[int]) -> set[str]:
        """Every data file a retained snapshot in the history of ``snapshot`` removed, down to
        the first snapshot in ``base`` (ids: the history a rollback moves the branch to, which
        loses those removals: what a rollback from ``snapshot`` takes out besides its live
        files)."""
        found: set[str] = set()
        for s in _history(snapshot, table.metadata):
            if s.snapshot_id in base:
                break
            if _may_remove(s):
                found |= self._removed_by(table, s)
        return found

    def removed_since(self, table: Table, head: Snapshot | None, group_id: str) -> set[str]:
        """Every data file a retained snapshot in the history of ``head`` above the newest
        snapshot of ``group_id`` removed: what the group's commit on ``head`` lists, so the
        removal still counts once those snapshots are expired
        (:func:`icefloe.commit.applied.with_removed`). Mostly nothing to read: the walk stops
        at the group's previous commit, usually the head or its parent."""
        found: set[str] = set()
        for snapshot in () if head is None else _history(head, table.metadata):
            if of_group(snapshot, group_id):
                break
            if _may_remove(snapshot):
                found |= self._removed_by(table, snapshot)
        return found

    def _removed_by(self, table: Table, snapshot: Snapshot) -> frozenset[str]:
        """The data files ``snapshot`` removed, read once per snapshot."""
        cached = self._removed.get(snapshot.manifest_list)
        if cached is None:
            cached = self._decode_removed(table, snapshot)
            self._removed.put(snapshot.manifest_list, cached)
        return cached

    @staticmethod
    def _decode_removed(table: Table, snapshot: Snapshot) -> frozenset[str]:
        """The DELETED entries of the data manifests ``snapshot`` wrote: the read the cache
        avoids (its list is read directly, not kept: it is not read again)."""
        return frozenset().union(
            *(
                _deleted_in(table, m)
                for m in snapshot.manifests(table.io)
                if _removes(m) and m.added_snapshot_id == snapshot.snapshot_id
            )
        )

    def _removed_below(self, table: Table, oldest: Snapshot) -> frozenset[str]:
        """The data files expired ancestors of ``oldest`` (the walk's oldest retained
        snapshot) removed, as far as its list still carries a data manifest one of them wrote.

        Why: a snapshot that removed files (icefloe's compaction, another engine's rewrite)
        may be expired while a later snapshot still carries the manifest it wrote, whose
        DELETED entries name those files; they were committed once. A manifest is carried
        from parent to child only, so every manifest in ``oldest``'s list that it did not
        write was written by an expired ancestor. Cached by manifest location (manifests
        never change), next to the removals cached by manifest list."""
        found: frozenset[str] = frozenset()
        for m in self.manifests(table, oldest):
            if _removes(m) and m.added_snapshot_id != oldest.snapshot_id:
                cached = self._removed.get(m.manifest_path)
                if cached is None:
                    cached = _deleted_in(table, m)
                    self._removed.put(m.manifest_path, cached)
                found |= cached
        return found

    def all_live(self, table: Table, snapshot: Snapshot) -> set[str]:
        """Every data file ``snapshot`` references as live (what a rollback from it may take
        out of the branch)."""
        return set().union(
            *(self._live_of(table, m) for m in self._data_manifests(table, snapshot))
        )

    def _live_of(self, table: Table, manifest: ManifestFile) -> frozenset[str]:
        cached = self._manifest_paths.get(manifest.manifest_path)
        if cached is None:
            cached = self._decode_live(table, manifest)
            self._cache_manifest(manifest.manifest_path, cached)
        return cached

    @staticmethod
    def _decode_live(table: Table, manifest: ManifestFile) -> frozenset[str]:
        """The live data-file paths of one manifest: the costly read the cache avoids."""
        return frozenset(
            canonical_path(e.data_file.file_path)
            for e in manifest.fetch_manifest_entry(table.io, discard_deleted=True)
        )

    def _cache_manifest(self, location: str, paths: frozenset[str]) -> None:
        self._manifest_paths.put(location, paths)

    def remember_added(self, table: Table, snapshot_id: int, appended: Iterable[str]) -> None:
        """Cache the paths of the manifests the commit of ``snapshot_id`` wrote (it appended
        the data files ``appended``), so the next commit's live-path check does not decode
        them again (as costly as writing them).

        A plain append writes one manifest holding exactly the files just appended. When
        pyiceberg also merged older manifests (``commit.manifest-merge.enabled``), the merged
        manifest holds the live paths of the manifests it replaced, which are cached already
        in a running committer: their union is its content. Each guess is checked against the
        manifest's file counts. Without this, the commit after every merge decoded the whole
        merged manifest.
        """
        try:
            snapshot = table.metadata.snapshot_by_id(snapshot_id)
            manifests = [] if snapshot is None else self._data_manifests(table, snapshot)
            written = [m for m in manifests if m.added_snapshot_id == snapshot_id]
            merged = [m for m in written if m.existing_files_count]
            older = self._replaced_paths(table, snapshot, manifests) if merged else frozenset()
        except Exception as exc:  # the commit landed; the cache is only an optimisation
            logger.debug("cannot list the manifests of snapshot %d: %s", snapshot_id, exc)
            return
        if older is None:
            return  # a replaced manifest is not cached: the next check decodes the merged one
        added = frozenset(canonical_path(p) for p in appended)
        own = [m for m in written if not m.existing_files_count]
        if len(written) == 1:  # the files just appended, with the replaced ones if merged
            guesses = [(written[0], older | added)]
        elif len(own) == 1 and len(merged) == 1:
            guesses = [(own[0], added), (merged[0], older)]
        else:
            return  # several merged bins: the next check decodes them
        for manifest, paths in guesses:
            if not manifest.deleted_files_count and len(paths) == (
                (manifest.existing_files_count or 0) + (manifest.added_files_count or 0)
            ):
                self._cache_manifest(manifest.manifest_path, paths)

    def _replaced_paths(
        self, table: Table, snapshot: Snapshot | None, manifests: list[ManifestFile]
    ) -> frozenset[str] | None:
        """The cached live paths of the parent's data manifests that ``snapshot`` no longer
        lists (the ones a merge replaced); None when one of them is not cached."""
        parent_id = None if snapshot is None else snapshot.parent_snapshot_id
        parent = None if parent_id is None else table.metadata.snapshot_by_id(parent_id)
        if parent is None:
            return None
        kept = {m.manifest_path for m in manifests}
        replaced = [
            self._manifest_paths.get(m.manifest_path)
            for m in self._data_manifests(table, parent)
            if m.manifest_path not in kept
        ]
        if any(paths is None for paths in replaced):
            return None
        return frozenset().union(*(paths for paths in replaced if paths is not None))

    def _data_manifests(self, table: Table, snapshot: Snapshot) -> list[ManifestFile]:
        return [m for m in self.manifests(table, snapshot) if m.content == ManifestContent.DATA]


def _removes(manifest: ManifestFile) -> bool:
    """Whether ``manifest`` is a data manifest with DELETED entries."""
    return manifest.content == ManifestContent.DATA and bool(manifest.deleted_files_count)


def _deleted_in(table: Table, manifest: ManifestFile) -> frozenset[str]:
    """The data files ``manifest`` lists as DELETED: the branch held each once (a snapshot
    in its line took it off)."""
    return frozenset(
        canonical_path(e.data_file.file_path)
        for e in manifest.fetch_manifest_entry(table.io, discard_deleted=False)
        if e.status == ManifestEntryStatus.DELETED
    )


def _may_remove(snapshot: Snapshot) -> bool:
    """Whether ``snapshot`` may have removed data files: not an ``append``, and not a commit
    of an icefloe pipeline (its appends and row deltas only add files; a row delta is an
    ``overwrite`` or ``delete`` by Iceberg's naming, one per cycle of an upsert table)."""
    summary = snapshot.summary
    if summary is None:
        return True
    return summary.operation != Operation.APPEND and summary[GROUP_ID_KEY] is None


def _history(head: Snapshot, metadata: TableMetadata) -> Iterator[Snapshot]:
    """``head`` and its retained ancestors, newest first, up to the first expired parent.

    Why not pyiceberg's ``ancestors_of``: it finds each parent by a linear scan of the
    table's snapshots, which made a walk over a long history quadratic, every cycle."""
    by_id = {s.snapshot_id: s for s in metadata.snapshots}
    snapshot: Snapshot | None = head
    seen: set[int] = set()
    while snapshot is not None and snapshot.snapshot_id not in seen:
        yield snapshot
        seen.add(snapshot.snapshot_id)
        parent = snapshot.parent_snapshot_id
        snapshot = None if parent is None else by_id.get(parent)
