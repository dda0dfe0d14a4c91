"""What the coordinator may delete: only files it can prove its pipeline owns.

``merge_small_files`` is the one place where icefloe deletes data files: once a merged
snapshot landed, the small files it replaced are garbage. The other is key files: once the
snapshot that applied an upsert/CDC batch's keys landed, its key file (never committed itself)
is garbage too (:mod:`icefloe.commit.applied`). But a DataWritten is only a claim
(a writer that lost its identity, a forged or buggy event), so the files it names are judged
here, against the table, before they are merged and again before they are deleted. A file is
the pipeline's to delete only when all of these hold:

* **written for this pipeline**: its name carries the group's tag
  (:func:`icefloe.records.datafiles.written_for`; icefloe's writers name their data files
  with :func:`icefloe.records.datafiles.group_write_uuid`, its Spark sink its key files too).
  Other engines' and other pipelines' files, and files written before the tag existed do not.
  The tag is
  a hash of the group id, not a signature: it tells the pipeline's files from everyone
  else's. A forged announcement of the group's files reaches only files no snapshot names
  (the pipeline's own, not yet committed), whose rows it commits, merged, before the delete;
  their own announcement then finds them held as committed (:mod:`icefloe.commit.dedupe`);
* **announced on this channel**: the files come from the commit request only, which the
  coordinator read from the channel the table's state was recorded through (the committer
  refuses a request through another, undrained channel);
* **under the table's data location** (``write.data.path``, else ``<location>/data``);
* **content data** (merged originals; a key file was applied as keys instead): announced as
  data, and its Parquet footer holds field ids of the table and none of Iceberg's reserved
  delete columns (:func:`icefloe.commit.screening.content_refusal`, checked by screening and
  before merging; a delete file announced as data is refused and quarantined, never merged as
  data);
* **referenced by no snapshot of any ref**: no manifest of any snapshot the table retains
  (every branch and tag points to one of them, and older snapshots serve time travel) names
  it, in any status. Judged on the table loaded for the merge and again on the table the
  commit returned, right before the delete;
* **never on an unknown commit outcome**: the delete runs only once the merged (or applying)
  snapshot is known to be in the table (the catalog accepted it, or a reload after an unknown
  outcome found it).

A file that fails any of the others is not merged at all: it is committed as announced, by
reference, so nothing is copied out of it and nothing is deleted (a file of another branch, or
one only an older snapshot or a tag keeps, stays where it is). Files the pipeline owns are
merged, and deleted once the merged snapshot landed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from pyiceberg.manifest import ManifestFile
from pyiceberg.table import Table
from pyiceberg.utils.concurrent import ExecutorFactory

from icefloe.commit import screening
from icefloe.commit.caches import SharedCache
from icefloe.events import DataFileMeta, FileContent
from icefloe.records.datafiles import written_for

_S = TypeVar("_S")
_T = TypeVar("_T")

# Manifest lists and manifests whose contents are kept in memory (immutable once written).
_MANIFEST_LIST_CACHE_SIZE = 65536
_MANIFEST_CACHE_SIZE = 65536


class Ownership:
    """The ownership proof of one pipeline (``group_id``).

    Proving "no snapshot names it" reads the manifest list of every retained snapshot and
    every manifest they list, as ``icefloe maintain`` does: both never change once written, so
    they are cached by location (a manifest by the paths of this pipeline's files it names,
    the only ones ever asked about), and after the first proof of a run only new snapshots'
    lists and new manifests are read, in parallel on pyiceberg's executor.
    """

    def __init__(self, group_id: str) -> None:
        self._group_id = group_id
        self._lists: SharedCache[str, tuple[ManifestFile, ...]] = SharedCache(
            _MANIFEST_LIST_CACHE_SIZE
        )
        self._named: SharedCache[str, frozenset[str]] = SharedCache(_MANIFEST_CACHE_SIZE)

    def mergeable(self, table: Table, files: Sequence[DataFileMeta]) -> set[str]:
        """The paths of ``files`` the pipeline provably owns in ``table`` (the version the
        merge reads): these may be merged, and deleted once the merged snapshot landed.

        Raises :class:`~icefloe.errors.NotADataFileError` for an owned-looking file whose
        footer is not a data file of the table (screening quarantines it first; reaching here
        means it was not screened): merging it would invent rows.
        """
        candidates = {m.path: m for m in files if m.content == FileContent.DATA}
        owned = self._owned(table, candidates)
        for path in sorted(owned):
            error = screening.content_refusal(table, candidates[path])
            if error is not None:
                raise error
        return owned

    def deletable(self, table: Table, paths: Iterable[str]) -> set[str]:
        """Which of ``paths`` (merged originals, proven owned when they were merged) may be
        deleted now: judged again on ``table``, the version holding the merged snapshot, so a
        file some snapshot came to reference meanwhile is kept."""
        return self._owned(table, paths)

    def _owned(self, table: Table, paths: Iterable[str]) -> set[str]:
        data = table.location_provider().data_path
        named = {
            p for p in paths if written_for(p, self._group_id) and screening.lies_under(p, data)
        }
        return named - self._referenced(table) if named else set()

    def _referenced(self, table: Table) -> set[str]:
        """This pipeline's files that a manifest of a snapshot ``table`` retains names (as
        data or delete file; added, existing or deleted)."""
        snapshots = {s.manifest_list: s for s in table.metadata.snapshots}
        lists = _cached(self._lists, snapshots, lambda s: tuple(s.manifests(table.io)))
        manifests = {m.manifest_path: m for listed in lists.values() for m in listed}
        named = _cached(self._named, manifests, lambda m: self._read(table, m))
        return set().union(*named.values())

    def _read(self, table: Table, manifest: ManifestFile) -> frozenset[str]:
        entries = manifest.fetch_manifest_entry(table.io, discard_deleted=False)
        paths = (e.data_file.file_path for e in entries)
        return frozenset(p for p in paths if written_for(p, self._group_id))


def _cached(
    cache: SharedCache[str, _T], items: dict[str, _S], read: Callable[[_S], _T]
) -> dict[str, _T]:
    """``read`` of every item by its location, reading (in parallel) only those ``cache``
    does not hold."""
    found: dict[str, _T] = {}
    for key in items:
        value = cache.get(key)  # one lookup: another thread may evict between two
        if value is not None:
            found[key] = value
    missing = [key for key in items if key not in found]
    executor = ExecutorFactory.get_or_create()
    for key, value in zip(missing, executor.map(lambda k: read(items[k]), missing), strict=True):
        cache.put(key, value)
        found[key] = value
    return found
