"""Keeping a continuously committed table's metadata bounded, and ``icefloe maintain``.

A pipeline commits one snapshot per table every few seconds. Left alone, every commit adds a
manifest that nothing merges and a metadata file that nothing deletes, and every later commit
(and every reader) pays for the history. Iceberg has table properties for each of these; icefloe
sets them on the tables it creates (:data:`RECOMMENDED_TABLE_PROPERTIES`) and ``icefloe doctor``
reports tables that lack them (:func:`table_property_advice`). The committer uses pyiceberg's
merge append, which merges manifests only when ``commit.manifest-merge.enabled`` is true.

``icefloe maintain`` expires old snapshots and deletes orphan files, safely next to a running
pipeline: it never expires the snapshots the committer's dedupe rule reads
(:func:`dedupe_snapshots`), and never deletes a file that is young, that a published, not
yet committed batch announces (:func:`announced_files`, read from the channel's stored
position, which is where the coordinator itself resumes, to the channel's end measured before
the read: a maintain that cannot read that far deletes nothing), or that the quarantine names
(its entry promises the rows back with ``add_files``).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import pyarrow.fs as pafs
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.snapshots import ancestors_of

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.compaction import CompactionResult, Thresholds
from icefloe.commit.dedupe import APPLIED_KEY, MERGED_KEY, RETIRED_KEY
from icefloe.commit.quarantine import Quarantine
from icefloe.commit.summary import (
    FENCING_TOKEN_KEY,
    GROUP_ID_KEY,
    SEQUENCE_NUMBER_KEY,
    STATE_KEY,
)
from icefloe.config import PipelineConfig
from icefloe.coordination.reading import announced_files
from icefloe.errors import ConfigError, MaintenanceError
from icefloe.ops.storage import hint, location_filesystem

#: Table properties icefloe sets on tables it creates, with why (for ``doctor``'s advice).
RECOMMENDED_TABLE_PROPERTIES: dict[str, tuple[str, str]] = {
    TableProperties.MANIFEST_MERGE_ENABLED: (
        "true",
        "every commit adds a manifest; merging them keeps planning and commits from slowing "
        "down with the table's history",
    ),
    TableProperties.MANIFEST_TARGET_SIZE_BYTES: (
        str(1024 * 1024),
        "pyiceberg merges manifests with a pure-Python Avro writer (~90 us per entry), so "
        "merging up to Iceberg's default 8 MB stalled one commit in ~40 for seconds; "
        "smaller merges, more often, keep every commit short",
    ),
    TableProperties.METADATA_DELETE_AFTER_COMMIT_ENABLED: (
        "true",
        "every commit writes a metadata file; without this none is ever deleted",
    ),
    TableProperties.METADATA_PREVIOUS_VERSIONS_MAX: (
        "50",
        "how many old metadata files to keep when deleting after commit",
    ),
}


def recommended_properties(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The properties for a new table: icefloe's recommendations, then ``overrides``."""
    props = {key: value for key, (value, _) in RECOMMENDED_TABLE_PROPERTIES.items()}
    props.update(overrides or {})
    return props


def table_property_advice(table: str, properties: Mapping[str, str]) -> list[str]:
    """A warning per recommended property that ``properties`` leaves unset (an explicit other
    value is the owner's choice and is respected)."""
    return [
        f"table '{table}': property {key} is not set; set it to {value} ({why})"
        for key, (value, why) in RECOMMENDED_TABLE_PROPERTIES.items()
        if key not in properties
    ]


# ---------------------------------------------------------------------- icefloe maintain


@dataclass(frozen=True)
class ExpiryResult:
    """What :func:`expire_snapshots` removed, and what it kept for the dedupe rule."""

    expired: tuple[int, ...]
    kept_for_dedupe: tuple[int, ...]


@dataclass(frozen=True)
class OrphanResult:
    """What :func:`remove_orphan_files` deleted (or would, in a dry run) and spared."""

    deleted: tuple[str, ...]
    kept_pending: tuple[str, ...]  # unreferenced, old enough, but announced by a writer
    kept_quarantined: tuple[str, ...] = ()  # unreferenced, old enough, but quarantined
    # unreferenced, old enough, but under another table's location (:func:`table_roots`)
    kept_other_tables: tuple[str, ...] = ()
    other_tables: tuple[str, ...] = ()  # those tables' locations, as listed


# rounds of `icefloe maintain --compact` per table that may meet a pipeline's commit
_COMPACT_ATTEMPTS = 3


def icefloe_groups(metadata: TableMetadata) -> set[str]:
    """Every pipeline that committed to the table (it left its fencing-token property)."""
    prefix = f"{FENCING_TOKEN_KEY}."
    return {k[len(prefix) :] for k in metadata.properties if k.startswith(prefix)}


def dedupe_snapshots(metadata: TableMetadata) -> set[int]:
    """Snapshots the committer's dedupe rule reads: on every branch, the chain from the head
    down to the newest snapshot of each pipeline (the committer walks exactly that chain to
    find what a pipeline already committed; a gap in it looks like lost history). On a branch
    rolled back below a pipeline's newest snapshot (its state property names a snapshot the
    chain does not reach: a rollback waiting for its replay), the whole chain and that
    snapshot: expiring them would leave a history that begins after the pipeline's snapshot,
    which the committer must take for another engine's expiry, and the replay would never
    come (found by the commit-path simulation). A rewrite above a pipeline's newest snapshot
    (its compaction's ``replace``) is kept with the chain until the pipeline's next commit,
    which lists the files it took off (:func:`icefloe.commit.applied.with_removed`)."""
    groups = icefloe_groups(metadata)
    keep: set[int] = set()
    for name, ref in metadata.refs.items():
        if ref.snapshot_ref_type != SnapshotRefType.BRANCH:
            continue
        chain: list[int] = []
        last_needed = -1
        missing = set(groups)
        for snapshot in ancestors_of(metadata.snapshot_by_id(ref.snapshot_id), metadata):
            chain.append(snapshot.snapshot_id)
            group = snapshot.summary[GROUP_ID_KEY] if snapshot.summary is not None else None
            if group in missing:
                missing.discard(group)
                last_needed = len(chain) - 1
                if not missing:
                    break
        keep.update(chain[: last_needed + 1])
        rolled_back = _rolled_back(metadata, name, chain)
        if rolled_back is not None:
            keep.update(chain)
            keep.update(rolled_back)
    return keep


def _rolled_back(metadata: TableMetadata, branch: str, chain: list[int]) -> set[int] | None:
    """Whether ``branch`` (whose history is ``chain``) was rolled back below the snapshot a
    pipeline's state property names: that snapshot is not in the history, and it still exists
    or the history reaches a snapshot older than it (sequence numbers grow along every line of
    descent; the property records the number). None if not; else the named snapshots that
    still exist."""
    snapshots = (metadata.snapshot_by_id(i) for i in chain)
    lowest = min((s.sequence_number or 0 for s in snapshots if s is not None), default=None)
    found: set[int] | None = None
    suffix = f".{branch}"
    for key, raw in metadata.properties.items():
        if not (key.startswith(f"{STATE_KEY}.") and key.endswith(suffix)):
            continue
        try:
            kept = json.loads(raw)
            snapshot_id = int(kept["snapshot-id"])
            number = int(kept.get(SEQUENCE_NUMBER_KEY) or 0)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # the committer refuses an unreadable state loudly; keep going here
        if snapshot_id in chain:
            continue
        exists = metadata.snapshot_by_id(snapshot_id) is not None
        if exists or (number and lowest is not None and lowest < number):
            found = (found or set()) | ({snapshot_id} if exists else set())
    return found


def expire_snapshots(
    table: Table, older_than_ms: int, retain_last: int = 1, dry_run: bool = False
) -> ExpiryResult:
    """Expire snapshots older than ``older_than_ms`` (epoch ms), except branch and tag heads,
    the ``retain_last`` newest, and :func:`dedupe_snapshots`. Data files are not deleted here
    (they become orphans once nothing references them; see :func:`remove_orphan_files`)."""
    metadata = table.metadata
    needed = dedupe_snapshots(metadata)
    heads = {ref.snapshot_id for ref in metadata.refs.values()}
    newest = sorted(metadata.snapshots, key=lambda s: s.timestamp_ms, reverse=True)
    recent = {s.snapshot_id for s in newest[: max(retain_last, 0)]}
    old = [s.snapshot_id for s in metadata.snapshots if s.timestamp_ms < older_than_ms]
    expired = [i for i in old if i not in needed and i not in heads and i not in recent]
    kept = sorted(i for i in old if i in needed and i not in heads)
    if expired and not dry_run:
        # optimistic: a concurrent pipeline commit makes this fail rather than race it
        table.maintenance.expire_snapshots().by_ids(expired).commit()
    return ExpiryResult(tuple(sorted(expired)), tuple(kept))


def _file_key(uri: str) -> str:
    """A path as pyarrow's file systems list it (``bucket/key`` for object stores)."""
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):
        return posixpath.normpath(parts.path)
    return posixpath.normpath(parts.netloc + parts.path)


def retired_writer_files(metadata: TableMetadata) -> set[str]:
    """The side files of the dedupe rule (retired writers, merged originals, applied files: see
    :mod:`icefloe.commit.dedupe`) named by remaining snapshots and by the groups' state
    properties: Iceberg does not know them, the dedupe rule needs them."""
    keys = (RETIRED_KEY, MERGED_KEY, APPLIED_KEY)
    found = {s.summary[k] for s in metadata.snapshots if s.summary is not None for k in keys}
    for key, raw in metadata.properties.items():
        if key.startswith(f"{STATE_KEY}."):
            try:
                summary = json.loads(raw)["summary"]
                found.update(summary.get(k) for k in keys)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # the committer refuses an unreadable state loudly; keep going here
    return {f for f in found if f}


def referenced_files(table: Table, expiring: Iterable[int] = ()) -> set[str]:
    """Every file the table's metadata still needs: metadata files in its log, manifest
    lists, manifests, data and delete files of every remaining snapshot, statistics, and the
    retired writers' watermarks. ``expiring``: snapshots taken as gone already (a dry run
    counts what the expiry it only reports would leave unreferenced)."""
    metadata = table.metadata
    refs = {table.metadata_location, *(e.metadata_file for e in metadata.metadata_log)}
    refs.update(retired_writer_files(metadata))
    refs.update(s.statistics_path for s in metadata.statistics)
    refs.update(s.statistics_path for s in metadata.partition_statistics)
    manifests: set[str] = set()
    gone = set(expiring)
    for snapshot in metadata.snapshots:
        if snapshot.snapshot_id in gone:
            continue
        refs.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            if manifest.manifest_path in manifests:
                continue
            manifests.add(manifest.manifest_path)
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
                refs.add(entry.data_file.file_path)
    return {_file_key(r) for r in refs | manifests}


def table_roots(paths: Iterable[str], location: str) -> set[str]:
    """The roots of the Iceberg tables whose metadata files lie in ``paths`` (as listed under
    ``location``), other than the table at ``location``: a ``<root>/metadata/`` folder
    holding a ``*.metadata.json`` or Hadoop's ``version-hint.text``. Why: a table whose
    location lies inside another's (a dead-letter table at ``<events>/dlq``) is, to the outer
    table, a tree of unreferenced files; deleting them as orphans destroyed it whole."""
    own = posixpath.normpath(location)
    roots: set[str] = set()
    for path in paths:
        folder, name = posixpath.split(path)
        if name.endswith(".metadata.json") or name == "version-hint.text":
            root, leaf = posixpath.split(folder)
            if leaf == "metadata" and root != own:
                roots.add(root)
    return roots


def table_paths(table: Table) -> list[str]:
    """Where ``table`` keeps files: its location, and the data and metadata paths its
    properties may move elsewhere. Why the paths too: another table whose ``write.data.path``
    lies inside this table's location has its data files there with no metadata folder beside
    them, and orphan removal of this table deleted them."""
    properties = table.properties
    moved = (TableProperties.WRITE_DATA_PATH, TableProperties.WRITE_METADATA_PATH)
    return [table.location(), *(p for key in moved if (p := properties.get(key)))]


def _loaded(catalog: Catalog, name: str) -> Table | None:
    try:
        return catalog.load_table(name)
    except NoSuchTableError:
        return None


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(f"{r}/") for r in roots)


def remove_orphan_files(
    table: Table,
    older_than_ms: int,
    pending: Iterable[str] = (),
    dry_run: bool = False,
    quarantined: Iterable[str] = (),
    expiring: Iterable[int] = (),
    other_tables: Iterable[str] = (),
) -> OrphanResult:
    """Delete files under the table location that no metadata references, that are older than
    ``older_than_ms`` (epoch ms: a file being written or committed right now is young), that
    no published, not yet committed batch announces (``pending``: their paths), that no
    quarantine entry names (``quarantined``: no snapshot and, once the channel moved past
    them, no batch names those files either; only the entry keeps them recoverable), and that
    lie under no other table's location (``other_tables``, the locations of the tables the
    caller knows, and every table root found in the listing: :func:`table_roots`).
    ``expiring``: snapshots a dry run would have expired first (see :func:`referenced_files`)."""
    referenced = referenced_files(table, expiring)
    announced = {_file_key(p) for p in pending}
    refused = {_file_key(p) for p in quarantined}
    fs, base = location_filesystem(table.location(), io=table.io)
    # pyarrow pages through object-store listings itself (S3: 1000 keys a request)
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    own = _file_key(table.location())
    others = {k for k in map(_file_key, other_tables) if k.startswith(f"{own}/")}
    others |= table_roots((i.path for i in infos if i.type == pafs.FileType.File), own)
    deleted: list[str] = []
    spared: list[str] = []
    kept: list[str] = []
    foreign: list[str] = []
    for info in infos:
        if info.type != pafs.FileType.File or info.path in referenced:
            continue
        if _under(info.path, others):
            foreign.append(info.path)
            continue
        mtime_ms = info.mtime_ns // 1_000_000 if info.mtime_ns is not None else older_than_ms
        if mtime_ms >= older_than_ms:
            continue
        if info.path in announced:
            spared.append(info.path)
            continue
        if info.path in refused:
            kept.append(info.path)
            continue
        if not dry_run:
            fs.delete_file(info.path)
        deleted.append(info.path)
    return OrphanResult(
        tuple(sorted(deleted)),
        tuple(sorted(spared)),
        tuple(sorted(kept)),
        tuple(sorted(foreign)),
        tuple(sorted(others)),
    )


def compact_table(committer: IcebergCommitter, name: str, dry_run: bool = False) -> str:
    """Compact every partition of ``name`` with position deletes or several small files (the
    operator asked: no threshold), on the table's branch, with its policy's target file size.
    Next to a running pipeline a round may meet a cycle's commit and then commits nothing: it
    is tried again a few times."""
    policy = committer.compaction_of(name) or Thresholds(
        target_file_size_bytes=committer.target_file_size_of(name)
    )
    compactor = committer.compactor()
    if dry_run:
        return f"{name}: would compact {compactor.pending(name, policy, force=True)} partition(s)"
    result = CompactionResult(name, None)
    for _ in range(_COMPACT_ATTEMPTS):
        result = compactor.compact(name, policy, force=True)
        if result.snapshot_id is not None or not result.skipped_partitions:
            break
    return result.describe()


def parse_age(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"`` or plain seconds, in seconds."""
    units = {"d": 86_400.0, "h": 3_600.0, "m": 60.0, "s": 1.0}
    raw = text.strip().lower()
    try:
        scale = units.get(raw[-1:], 0.0)
        value = float(raw[:-1]) * scale if scale else float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ConfigError("maintain age", f"'{text}' is not an age", 'write e.g. "7d", "12h"')
    return value


def maintain(
    config: PipelineConfig,
    tables: Iterable[str] = (),
    expire_older_than_s: float = 7 * 86_400.0,
    retain_last: int = 1,
    orphans_older_than_s: float = 3 * 86_400.0,
    dry_run: bool = False,
    compact: bool = False,
) -> list[str]:
    """``icefloe maintain``: with ``compact`` first compact (:func:`compact_table`), then
    expire snapshots, then delete orphan files, in every table the pipeline commits to
    (:func:`icefloe.ops.tables.pipeline_tables`) or in ``tables``; returns one line per
    table and step for the operator. In that order because a compaction un-references files
    that only expiry and then orphan removal delete."""
    import time

    from pyiceberg.catalog import load_catalog

    from icefloe.ops.tables import pipeline_tables
    from icefloe.plugins.backends import open_backend

    now_ms = int(time.time() * 1000)
    backend = open_backend(config)
    try:
        channel = backend.coordinator(f"maintain-{now_ms}")
        try:
            pending = announced_files(channel, config.name)
        finally:
            channel.close()
    finally:
        backend.close()
    catalog = load_catalog(config.catalog.name, **config.catalog.properties)
    # after the channel: the coordinator records a refused file before it stores a position
    # past its batch, so every file is in one of the two sets (fails rather than guess)
    quarantined = Quarantine(catalog, config.coordination.quarantine_table).all_paths()
    names = list(tables) or pipeline_tables(catalog, config)
    # the tables this run knows, so none lying inside another's location is taken for its
    # orphans (table_roots finds the others by their metadata files)
    known = [*names, config.coordination.quarantine_table]
    places = {n: table_paths(t) for n in known if (t := _loaded(catalog, n)) is not None}
    lines: list[str] = []
    committer = IcebergCommitter.for_pipeline(catalog, config) if compact else None
    # the quarantine table too: every leader change adds an empty snapshot to it (its fence),
    # and retiring entries rewrites its files, so unmaintained its metadata grows for good
    quarantine = config.coordination.quarantine_table
    covered = [*names, quarantine] if not tables and quarantine in places else names
    for name in covered:
        if committer is not None and name != quarantine:
            lines.append(compact_table(committer, name, dry_run))
        lines += _expire_and_remove_orphans(
            catalog,
            name,
            now_ms - int(expire_older_than_s * 1000),
            retain_last,
            now_ms - int(orphans_older_than_s * 1000),
            dry_run,
            (pending, quarantined),
            [p for n, paths in places.items() if n != name for p in paths],
        )
    return lines


def _expire_and_remove_orphans(
    catalog: Catalog,
    name: str,
    expire_before_ms: int,
    retain_last: int,
    orphans_before_ms: int,
    dry_run: bool,
    keep: tuple[set[str], set[str]],
    other_tables: list[str],
) -> list[str]:
    """One table's expiry, then its orphan removal (``keep``: the files announced by
    uncommitted batches and the quarantined ones); the operator's two lines."""
    pending, quarantined = keep
    verb = "would " if dry_run else ""
    with _store_step(name, "expiring snapshots", catalog.properties):
        expiry = expire_snapshots(catalog.load_table(name), expire_before_ms, retain_last, dry_run)
    with _store_step(name, "deleting orphan files", catalog.properties):
        orphans = remove_orphan_files(
            catalog.load_table(name),
            orphans_before_ms,
            pending,
            dry_run,
            quarantined,
            expiring=expiry.expired if dry_run else (),  # as if expired: the count agrees
            other_tables=other_tables,
        )
    return [
        f"{name}: {verb}expire {len(expiry.expired)} snapshot(s); kept "
        f"{len(expiry.kept_for_dedupe)} old one(s) the dedupe rule reads",
        f"{name}: {verb}delete {len(orphans.deleted)} orphan file(s); kept "
        f"{len(orphans.kept_pending)} announced by uncommitted batches, "
        f"{len(orphans.kept_quarantined)} quarantined"
        + (
            f", {len(orphans.kept_other_tables)} of other tables inside its location "
            f"({', '.join(orphans.other_tables)})"
            if orphans.kept_other_tables
            else ""
        ),
    ]


@contextmanager
def _store_step(table: str, step: str, properties: Mapping[str, str]) -> Iterator[None]:
    """Turn the store's refusal (pyarrow's OSError: a missing permission, a wrong key) into a
    :class:`MaintenanceError` naming the table, the step and the catalog property to check,
    so ``icefloe maintain`` ends with one line instead of a traceback."""
    try:
        yield
    except OSError as exc:
        text = " ".join(str(exc).split())
        raise MaintenanceError(
            f"table {table}: {step} stopped: {hint(text, properties) or text}; what was done "
            "before stays done and no file a snapshot references was touched (the permissions "
            "icefloe maintain needs: docs/operations.md, 'Object store (S3)')"
        ) from exc
