"""Which announced files a branch head already references as live data files.

Answering that reads the head's data manifests, which grows with the table; manifests never
change once written, so their live paths are cached by location and a running committer
decodes only manifests it has not seen (and not even the ones it wrote itself). Manifest
lists never change either: a snapshot's list is decoded once, not at every check.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pyiceberg.manifest import ManifestContent, ManifestFile
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot

from icefloe.commit.caches import SharedCache
from icefloe.commit.screening import canonical_path

logger = logging.getLogger("icefloe.committer")

# Manifests whose live paths are kept in memory (oldest dropped first).
_MANIFEST_CACHE_SIZE = 4096
# Manifest lists kept decoded (a few per table: the heads just checked and committed).
_LIST_CACHE_SIZE = 4096


class LiveFiles:
    """The live data-file paths of manifests (canonical: :func:`canonical_path`), cached by
    manifest location."""

    def __init__(self) -> None:
        # manifest location -> live paths; manifest list -> its manifests
        self._manifest_paths: SharedCache[str, frozenset[str]] = SharedCache(_MANIFEST_CACHE_SIZE)
        self._lists: SharedCache[str, tuple[ManifestFile, ...]] = SharedCache(_LIST_CACHE_SIZE)

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
