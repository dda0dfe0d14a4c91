"""Writing Iceberg data files and converting their metadata to and from control events.

Writers turn Arrow data into Parquet files with pyiceberg's own writer (it honours the table's
partition spec, write properties and target file size, and computes column statistics);
the resulting file metadata travels in DataWritten events, and the committer turns it back into
pyiceberg ``DataFile`` objects without opening the files.
"""

from __future__ import annotations

import functools
import hashlib
import os
import posixpath
import re
import uuid
from collections.abc import Iterable
from dataclasses import replace
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
from pyiceberg.schema import Schema
from pyiceberg.table import Table, TableProperties, WriteTask
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.typedef import Record
from pyiceberg.types import DecimalType, StructType

from icefloe.events import DataFileMeta, FileContent, PartitionScalar, PartitionValue

if TYPE_CHECKING:  # the writers' side: reading file names and metadata needs no Arrow
    import pyarrow as pa

_CONTENT_TO_ICEBERG = {
    FileContent.DATA: DataFileContent.DATA,
    FileContent.POSITION_DELETES: DataFileContent.POSITION_DELETES,
    FileContent.EQUALITY_DELETES: DataFileContent.EQUALITY_DELETES,
}
_CONTENT_FROM_ICEBERG = {v: k for k, v in _CONTENT_TO_ICEBERG.items()}

# pyiceberg names a data file ``00000-<task>-<write uuid>.<format>`` (as Iceberg Java does)
_DATA_FILE_NAME = re.compile(
    r"^\d+-\d+-([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\."
)
_GROUP_TAG_BYTES = 6


@functools.cache
def _group_tag(group_id: str) -> bytes:
    return hashlib.sha256(f"icefloe-group:{group_id}".encode()).digest()[:_GROUP_TAG_BYTES]


def group_write_uuid(group_id: str) -> uuid.UUID:
    """A fresh write uuid for data files written for pipeline ``group_id``: its first 48 bits
    are a hash of the group id, the rest random (74 bits), with the version bits of a
    vendor-defined (version 8) uuid. pyiceberg puts the write uuid into every file name, so the
    name says which pipeline a file was written for (:func:`written_for`).

    Why: ``merge_small_files`` deletes the originals it merged, and may delete only files the
    pipeline owns (:mod:`icefloe.commit.ownership`); a file's metadata says nothing about who
    wrote it, its name now does. It is a tag, not a signature: anyone who knows the group id
    can compute it, so it tells the pipeline's files from other engines' and other
    pipelines', not from a forgery (the other conditions of the ownership rule cover that).
    """
    value = int.from_bytes(_group_tag(group_id) + os.urandom(16 - _GROUP_TAG_BYTES), "big")
    value = (value & ~(0xF000 << 64)) | (0x8000 << 64)  # version 8
    value = (value & ~(0xC000 << 48)) | (0x8000 << 48)  # the RFC 4122 variant
    return uuid.UUID(int=value)


def written_for(path: str, group_id: str) -> bool:
    """Whether the data file at ``path`` was named for pipeline ``group_id`` by
    :func:`group_write_uuid` (files written before the tag existed are not)."""
    found = _DATA_FILE_NAME.match(posixpath.basename(path))
    if found is None:
        return False
    tagged = uuid.UUID(found.group(1))
    return tagged.version == 8 and tagged.bytes[:_GROUP_TAG_BYTES] == _group_tag(group_id)


def _scalar(value: Any) -> PartitionScalar:
    """Partition values are physical already (days, micros, bytes); Decimal and UUID need a
    carrier type that Avro's union holds."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, uuid.UUID):
        return value.bytes
    raise TypeError(f"unsupported partition value type {type(value).__name__}")


def to_meta(data_file: DataFile, table_metadata: TableMetadata) -> DataFileMeta:
    """Describe a pyiceberg DataFile completely, so it can be committed without reading it."""
    # pyiceberg's writer leaves spec_id unset on new files: they use the default spec
    spec_id = getattr(data_file, "_spec_id", table_metadata.default_spec_id)
    spec = table_metadata.specs()[spec_id]
    partition = tuple(
        PartitionValue(f.field_id, f.name, _scalar(data_file.partition[i]))
        for i, f in enumerate(spec.fields)
    )
    return _meta(data_file, spec_id, partition)


def _meta(data_file: DataFile, spec_id: int, partition: tuple[PartitionValue, ...]) -> DataFileMeta:
    return DataFileMeta(
        path=data_file.file_path,
        record_count=data_file.record_count,
        file_size_in_bytes=data_file.file_size_in_bytes,
        file_format=data_file.file_format.name,
        content=_CONTENT_FROM_ICEBERG[data_file.content],
        spec_id=spec_id,
        partition=partition,
        column_sizes=dict(data_file.column_sizes or {}),
        value_counts=dict(data_file.value_counts or {}),
        null_value_counts=dict(data_file.null_value_counts or {}),
        nan_value_counts=dict(data_file.nan_value_counts or {}),
        lower_bounds=dict(data_file.lower_bounds or {}),
        upper_bounds=dict(data_file.upper_bounds or {}),
        split_offsets=None if data_file.split_offsets is None else tuple(data_file.split_offsets),
        equality_ids=None if data_file.equality_ids is None else tuple(data_file.equality_ids),
        sort_order_id=data_file.sort_order_id,
    )


def to_data_file(meta: DataFileMeta, table_metadata: TableMetadata) -> DataFile:
    """The pyiceberg DataFile for ``meta``, typed by the table's partition spec ``spec_id``."""
    return DataFileBuilder(table_metadata).build(meta)


class DataFileBuilder:
    """Builds DataFiles for one table version, computing each spec's partition type once.

    Why: a commit converts every file of a cycle (10,000s), and building the partition type
    per file cost as much as the rest of the conversion.
    """

    def __init__(self, table_metadata: TableMetadata) -> None:
        self._metadata = table_metadata
        self._specs = table_metadata.specs()
        self._types: dict[int, StructType] = {}

    def _partition_type(self, meta: DataFileMeta) -> StructType:
        ptype = self._types.get(meta.spec_id)
        if ptype is None:
            if meta.spec_id not in self._specs:
                raise ValueError(f"{meta.path}: partition spec {meta.spec_id} is not in the table")
            ptype = self._specs[meta.spec_id].partition_type(self._metadata.schema())
            self._types[meta.spec_id] = ptype
        return ptype

    def build(self, meta: DataFileMeta) -> DataFile:
        """The DataFile for ``meta``; ValueError when its spec is not in the table."""
        ptype = self._partition_type(meta)
        by_id = {p.field_id: p.value for p in meta.partition}
        values: list[Any] = []
        for f in ptype.fields:
            v: Any = by_id.get(f.field_id)
            if isinstance(f.field_type, DecimalType) and isinstance(v, str):
                v = Decimal(v)
            values.append(v)
        df = DataFile.from_args(
            _table_format_version=self._metadata.format_version,
            content=_CONTENT_TO_ICEBERG[meta.content],
            file_path=meta.path,
            file_format=FileFormat[meta.file_format],
            partition=Record(*values),
            record_count=meta.record_count,
            file_size_in_bytes=meta.file_size_in_bytes,
            column_sizes=meta.column_sizes,
            value_counts=meta.value_counts,
            null_value_counts=meta.null_value_counts,
            nan_value_counts=meta.nan_value_counts,
            lower_bounds=meta.lower_bounds,
            upper_bounds=meta.upper_bounds,
            split_offsets=None if meta.split_offsets is None else list(meta.split_offsets),
            equality_ids=None if meta.equality_ids is None else list(meta.equality_ids),
            sort_order_id=meta.sort_order_id,
        )
        df.spec_id = meta.spec_id
        return df


def write_data_files(
    table: Table,
    data: pa.Table,
    write_uuid: uuid.UUID | None = None,
    target_file_size: int | None = None,
) -> list[DataFileMeta]:
    """Write ``data`` (already in the table's schema) as Parquet data files in the table's
    location, honouring its partition spec and write properties; commit nothing. The files are
    named after ``write_uuid`` (and their order), so the same uuid writes the same names.
    ``target_file_size`` overrides the table's ``write.target-file-size-bytes``.

    Uses pyiceberg's internal ``_dataframe_to_data_files`` because pyiceberg's public API
    offers only write-and-commit (``append``), and writers must never commit. What pyiceberg
    derives per file from the table's schema, spec and properties is kept per table version
    (:mod:`icefloe.records.writeplan`): the same files, less CPU per small file.
    """
    from pyiceberg.io.pyarrow import _dataframe_to_data_files

    from icefloe.records import writeplan

    if data.num_rows == 0:
        return []
    metadata = table.metadata
    if target_file_size is not None:
        properties = {
            **metadata.properties,
            TableProperties.WRITE_TARGET_FILE_SIZE_BYTES: str(target_file_size),
        }
        metadata = metadata.model_copy(update={"properties": properties})
    with writeplan.writing():
        planned = writeplan.planned_metadata(metadata, writeplan.plan_for(metadata, data.schema))
        files: Iterable[DataFile] = _dataframe_to_data_files(
            table_metadata=planned, df=data, io=table.io, write_uuid=write_uuid
        )
        return [to_meta(f, table.metadata) for f in files]


def write_key_files(
    table: Table, keys: pa.Table, write_uuid: uuid.UUID | None = None
) -> list[DataFileMeta]:
    """Write the keys an upsert/CDC task touched (``keys``: the table's identifier columns by
    name, as :class:`icefloe.records.converter.Conversion` gives them) as one Parquet file next to
    the table's
    data files, announced as equality deletes on those columns; commit nothing.

    The file holds only the key columns, with their field ids. It is unpartitioned
    (``partition`` empty): a changed row may have lived in any partition, so the coordinator
    resolves its keys against the whole table. pyiceberg's ``write_file`` writes the
    table's current schema, so it gets a copy of the metadata whose schema is the key columns
    alone (pyiceberg has no public way to write a file of some columns without committing).
    """
    from pyiceberg.io.pyarrow import schema_to_pyarrow, write_file

    from icefloe.records.changes import leaf_fields

    if keys.num_rows == 0:
        return []
    schema = table.schema()
    # the key columns by their full names: one nested in a struct comes in that struct, whose
    # other fields a key file leaves out
    names = [".".join(path) for path, _ in leaf_fields(keys.schema)]
    key_schema = schema.select(*names, case_sensitive=True)
    key_schema = Schema(*key_schema.fields, schema_id=schema.schema_id)
    metadata = table.metadata.model_copy(
        update={"schemas": [key_schema], "current_schema_id": schema.schema_id}
    )
    arrow = schema_to_pyarrow(key_schema)
    task = WriteTask(
        write_uuid=write_uuid or uuid.uuid4(),
        task_id=0,
        schema=key_schema,
        record_batches=keys.select(arrow.names).cast(arrow).to_batches(),
    )
    files = write_file(table.io, metadata, iter([task]))
    ids = tuple(sorted(schema.find_field(name).field_id for name in names))
    # the table's unpartitioned spec when it has one: equality deletes there apply everywhere
    specs = table.metadata.specs()
    spec_id = next((i for i, s in specs.items() if not s.fields), table.metadata.default_spec_id)
    return [
        replace(_meta(f, spec_id, ()), content=FileContent.EQUALITY_DELETES, equality_ids=ids)
        for f in files
    ]
