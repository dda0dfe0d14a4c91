"""The plain append, built from pyiceberg's public parts instead of its transaction.

Why: pyiceberg's ``Transaction`` re-derives the table metadata, as a deep copy, on every read
of ``table_metadata``; its snapshot producer reads it about fifteen times per append, which was
half the CPU of a commit of a few files and grew with the table's history. A coordinator
committing hundreds of tables per cycle pays it per table. The commit this module builds is the
one pyiceberg's fast append builds: one new manifest of the added data files, a manifest list of
it plus the branch head's live manifests, a snapshot with pyiceberg's summary totals and the
caller's properties, the branch moved to it, and the table properties set or removed in the same
catalog commit, which requires the branch head (and table uuid) to be the one planned against.

The row delta of a keyed table (its data files plus the position-delete files its key files
resolved to) is built the same way, with the delete files in a DELETES manifest per partition
spec, as icefloe's subclass of pyiceberg's merge append (:mod:`icefloe.commit.rowdelta`) builds
it: without this, a keyed table's commit grew with its snapshot history (about 2x over the
snapshots of 100 cycles, measured with ``benchmarks/bench_upsert.py --cycles``).

It is used only where it is that same commit (:func:`applicable`): data (and, on format v2,
delete) files added to a format v1/v2 table, the branch existing (or ``main`` on a table
without snapshots), and no manifest merge that pyiceberg's merge append would do
(``commit.manifest-merge.enabled`` with enough manifests, or manifests of older partition
specs). Everything else (a branch to fork, a merge due) goes through pyiceberg's transaction.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io import OutputFile
from pyiceberg.manifest import (
    DataFile,
    ManifestContent,
    ManifestEntry,
    ManifestEntryStatus,
    ManifestFile,
)
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import (
    Operation,
    Snapshot,
    SnapshotSummaryCollector,
    Summary,
    update_snapshot_summaries,
)
from pyiceberg.table.update import (
    AddSnapshotUpdate,
    AssertRefSnapshotId,
    AssertTableUUID,
    RemovePropertiesUpdate,
    SetPropertiesUpdate,
    SetSnapshotRefUpdate,
    TableRequirement,
    TableUpdate,
)
from pyiceberg.utils.properties import property_as_bool, property_as_int

from icefloe.commit.manifestio import ManifestWriterV2Prepared, write_manifest, write_manifest_list
from icefloe.commit.request import table_name
from icefloe.commit.versions import commit_table, with_metadata
from icefloe.errors import CommitError


@dataclass(frozen=True)
class StagedAppend:
    """An append whose manifest and manifest list are written, ready for the catalog."""

    table: Table
    snapshot_id: int
    updates: tuple[TableUpdate, ...]
    requirements: tuple[TableRequirement, ...]
    manifest_list: str
    manifests: tuple[ManifestFile, ...]  # as the manifest list holds them
    written: int = 1  # the first ``written`` manifests are this commit's, the others the head's

    @property
    def _written(self) -> list[str]:
        """The manifests this commit wrote."""
        return [m.manifest_path for m in self.manifests[: self.written]]

    def commit(self) -> Table:
        """Commit to the catalog; returns the table as committed. Raises what the catalog
        raises (CommitFailedException when the branch head or the table changed)."""
        table = self.table
        try:
            response = commit_table(table, self.requirements, self.updates)
        except CommitFailedException:
            # refused for sure (an unknown outcome keeps them: the snapshot may have landed)
            for path in (self.manifest_list, *self._written):
                with contextlib.suppress(Exception):
                    table.io.delete(path)
            raise
        if response.metadata.table_uuid != table.metadata.table_uuid:
            raise CommitError(f"table '{table_name(table)}': its uuid changed during the commit")
        _delete_old_metadata(table, response.metadata)
        return with_metadata(table, response.metadata, response.metadata_location)


def applicable(table: Table, branch: str, head: Snapshot | None) -> bool:
    """Whether a plain append to ``branch`` (head ``head``) can be built here (see the
    module docstring; the manifest merge is judged by :func:`stage`)."""
    metadata = table.metadata
    if metadata.format_version not in (1, 2):
        return False
    ref = metadata.refs.get(branch)
    if ref is None:
        return branch == MAIN_BRANCH and head is None
    return ref.snapshot_ref_type == SnapshotRefType.BRANCH and head is not None


def stage(
    table: Table,
    branch: str,
    head: Snapshot | None,
    head_manifests: Sequence[ManifestFile],
    data_files: Sequence[DataFile],
    snapshot_properties: Mapping[str, str],
    set_properties: Mapping[str, str],
    remove_properties: Sequence[str],
    snapshot_id: int,
    delete_files: Sequence[DataFile] = (),
) -> StagedAppend | None:
    """Write the manifests and the manifest list of adding ``data_files`` (and
    ``delete_files``) on top of ``head`` (whose manifests are ``head_manifests``) as snapshot
    ``snapshot_id``. None when pyiceberg's merge append would merge manifests here, or delete
    files meet a format v1 table: the caller commits through pyiceberg instead."""
    metadata = table.metadata
    spec, schema = metadata.spec(), metadata.schema()
    props = metadata.properties
    if delete_files and metadata.format_version < 2:
        return None  # pyiceberg's path says what is wrong
    compression = props.get(
        TableProperties.WRITE_AVRO_COMPRESSION, TableProperties.WRITE_AVRO_COMPRESSION_DEFAULT
    )
    commit_uuid = uuid.uuid4()
    locations = table.location_provider()
    existing = [m for m in head_manifests if m.has_added_files() or m.has_existing_files()]
    data = [m for m in existing if m.content == ManifestContent.DATA]
    merging = property_as_bool(
        props,
        TableProperties.MANIFEST_MERGE_ENABLED,
        TableProperties.MANIFEST_MERGE_ENABLED_DEFAULT,
    )
    if merging and _merge_possible(props, spec.spec_id, data):
        return None
    added: list[ManifestFile] = []

    def output() -> OutputFile:
        return table.io.new_output(
            locations.new_metadata_location(f"{commit_uuid}-m{len(added)}.avro")
        )

    if data_files:
        with write_manifest(
            format_version=metadata.format_version,
            spec=spec,
            schema=schema,
            output_file=output(),
            snapshot_id=snapshot_id,
            avro_compression=compression,
        ) as writer:
            for entry in added_entries(snapshot_id, data_files):
                writer.add(entry)
        added.append(writer.to_manifest_file())
        if merging and not _one_bin(props, data, added[0]):
            table.io.delete(added[0].manifest_path)
            return None
    specs = metadata.specs()
    for spec_id, files in by_spec(delete_files):
        entries = added_entries(snapshot_id, files)
        added.append(
            delete_manifest(specs[spec_id], schema, output(), snapshot_id, compression, entries)
        )
    sequence_number = metadata.next_sequence_number()
    list_path = locations.new_metadata_location(f"snap-{snapshot_id}-0-{commit_uuid}.avro")
    with write_manifest_list(
        format_version=metadata.format_version,
        output_file=table.io.new_output(list_path),
        snapshot_id=snapshot_id,
        parent_snapshot_id=None if head is None else head.snapshot_id,
        sequence_number=sequence_number,
        avro_compression=compression,
    ) as list_writer:
        # as written (sequence numbers assigned), so the caller may keep them as the list's
        # content instead of reading it back
        manifests = tuple(list_writer.prepare_manifest(m) for m in (*added, *existing))
        list_writer.add_manifests(list(manifests))
    collector = SnapshotSummaryCollector(
        partition_summary_limit=property_as_int(  # type: ignore[arg-type]
            props,
            TableProperties.WRITE_PARTITION_SUMMARY_LIMIT,
            TableProperties.WRITE_PARTITION_SUMMARY_LIMIT_DEFAULT,
        )
    )
    # as pyiceberg's producer: every added file (delete files counted by their content)
    # under the default spec
    for added_file in (*data_files, *delete_files):
        collector.add_file(added_file, schema=schema, partition_spec=spec)
    summary = update_snapshot_summaries(
        Summary(operation_of(data_files, delete_files), **collector.build(), **snapshot_properties),
        previous_summary=None if head is None else head.summary,
    )
    # pyiceberg's models take field names (populate_by_name); mypy's plugin knows only aliases
    snapshot = Snapshot(  # type: ignore[call-arg]
        snapshot_id=snapshot_id,
        parent_snapshot_id=None if head is None else head.snapshot_id,
        manifest_list=list_path,
        sequence_number=sequence_number,
        summary=summary,
        schema_id=metadata.current_schema_id,
    )
    updates: list[TableUpdate] = [
        AddSnapshotUpdate(snapshot=snapshot),
        SetSnapshotRefUpdate(  # type: ignore[call-arg]
            snapshot_id=snapshot_id,
            parent_snapshot_id=snapshot.parent_snapshot_id,
            ref_name=branch,
            type=SnapshotRefType.BRANCH,
        ),
    ]
    if set_properties:
        updates.append(SetPropertiesUpdate(updates=dict(set_properties)))
    if remove_properties:
        updates.append(RemovePropertiesUpdate(removals=list(remove_properties)))
    requirements = (
        AssertTableUUID(uuid=metadata.table_uuid),
        AssertRefSnapshotId(  # type: ignore[call-arg]
            snapshot_id=None if head is None else head.snapshot_id,
            ref=branch,
        ),
    )
    return StagedAppend(
        table, snapshot_id, tuple(updates), requirements, list_path, manifests, len(added)
    )


def operation_of(data_files: Sequence[DataFile], delete_files: Sequence[DataFile]) -> Operation:
    """The snapshot operation of adding these files: a row delta with both overwrites."""
    if data_files and delete_files:
        return Operation.OVERWRITE
    return Operation.DELETE if delete_files else Operation.APPEND


def added_entries(snapshot_id: int, files: Iterable[DataFile]) -> Iterator[ManifestEntry]:
    """Manifest entries adding ``files`` in ``snapshot_id`` (sequence numbers inherited)."""
    for f in files:
        yield ManifestEntry.from_args(
            status=ManifestEntryStatus.ADDED,
            snapshot_id=snapshot_id,
            sequence_number=None,
            file_sequence_number=None,
            data_file=f,
        )


def by_spec(delete_files: Iterable[DataFile]) -> list[tuple[int, list[DataFile]]]:
    """Delete files grouped by partition spec id: a manifest holds one spec's files."""
    groups: dict[int, list[DataFile]] = {}
    for f in delete_files:
        groups.setdefault(f.spec_id or 0, []).append(f)
    return sorted(groups.items())


class _DeleteManifestWriter(ManifestWriterV2Prepared):
    """pyiceberg's v2 manifest writer always declares DATA content; delete files need a
    manifest whose content (in the manifest list and its own metadata) is DELETES."""

    def content(self) -> ManifestContent:
        return ManifestContent.DELETES

    @property
    def _meta(self) -> dict[str, str]:
        return {**super()._meta, "content": "deletes"}


def delete_manifest(
    spec: PartitionSpec,
    schema: Schema,
    output: OutputFile,
    snapshot_id: int,
    compression: Any,
    entries: Iterable[ManifestEntry],
) -> ManifestFile:
    """One DELETES manifest of ``entries`` (files of ``spec``) for snapshot ``snapshot_id``."""
    writer = _DeleteManifestWriter(
        spec=spec,
        schema=schema,
        output_file=output,
        snapshot_id=snapshot_id,
        avro_compression=compression,
    )
    with writer:
        for entry in entries:
            writer.add_entry(entry)
    return writer.to_manifest_file()


def _merge_possible(props: dict[str, str], spec_id: int, data: Sequence[ManifestFile]) -> bool:
    """Whether pyiceberg's merge append might merge some of ``data`` (the head's data
    manifests) whatever the new manifest: enough manifests for the new one's bin, or
    manifests of another spec (packed and merged in bins of their own)."""
    min_count = property_as_int(
        props,
        TableProperties.MANIFEST_MIN_MERGE_COUNT,
        TableProperties.MANIFEST_MIN_MERGE_COUNT_DEFAULT,
    )
    assert min_count is not None
    return len(data) + 1 >= min_count or any(m.partition_spec_id != spec_id for m in data)


def _one_bin(props: dict[str, str], data: Sequence[ManifestFile], added: ManifestFile) -> bool:
    """Whether the new manifest and ``data`` fit in one bin of the merge's target size: the
    merge append splits them into several bins otherwise, and merges a bin without the new
    manifest whatever its count, so the decision is left to pyiceberg."""
    target = property_as_int(
        props,
        TableProperties.MANIFEST_TARGET_SIZE_BYTES,
        TableProperties.MANIFEST_TARGET_SIZE_BYTES_DEFAULT,
    )
    assert target is not None
    return added.manifest_length + sum(m.manifest_length for m in data) <= target


def _delete_old_metadata(table: Table, committed: TableMetadata) -> None:
    """Delete the metadata files that left the metadata log, when the table asks for it
    (``write.metadata.delete-after-commit.enabled``), as pyiceberg's commit does."""
    if not property_as_bool(
        committed.properties,
        TableProperties.METADATA_DELETE_AFTER_COMMIT_ENABLED,
        TableProperties.METADATA_DELETE_AFTER_COMMIT_ENABLED_DEFAULT,
    ):
        return
    kept = {e.metadata_file for e in committed.metadata_log}
    for entry in table.metadata.metadata_log:
        if entry.metadata_file not in kept:
            try:
                table.io.delete(entry.metadata_file)
            except Exception:  # committed either way: the file is only garbage now
                continue
