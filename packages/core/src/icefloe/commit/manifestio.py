"""Manifest and manifest-list writers that build their Avro encoding once per schema.

Why: for every file it writes, pyiceberg derives the manifest entry schema with the partition
spec's type, builds an Avro writer tree for it by visiting the schema, converts the schema to
Avro's JSON for the header, and builds the header's writer the same way. At hundreds of
tables per cycle that was about a quarter of a table commit's CPU (profile in
docs/benchmarks.md, "Coordinator at scale"), yet all of it depends only on the format version
and the partition type. pyiceberg's writer trees are frozen dataclasses without state, so one
tree serves every file and every committer thread.

Everything else is pyiceberg's: its writer classes (entries, counts, sequence numbers, the
header's metadata) and its ``AvroOutputFile`` (blocks, codecs, sync markers). Only the
construction is reused, so the files are byte for byte what pyiceberg writes
(``test_manifestio.py`` compares them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pyiceberg.avro.codecs import AVRO_CODEC_KEY, CODEC_MAPPING_ICEBERG_TO_AVRO
from pyiceberg.avro.file import (
    _SCHEMA_KEY,
    MAGIC,
    META_SCHEMA,
    SYNC_SIZE,
    AvroFileHeader,
    AvroOutputFile,
)
from pyiceberg.avro.resolver import construct_writer, resolve_writer
from pyiceberg.avro.writer import Writer
from pyiceberg.io import OutputFile
from pyiceberg.manifest import (
    DEFAULT_READ_VERSION,
    MANIFEST_LIST_FILE_SCHEMAS,
    ManifestEntry,
    ManifestFile,
    ManifestListWriter,
    ManifestListWriterV1,
    ManifestListWriterV2,
    ManifestWriter,
    ManifestWriterV1,
    ManifestWriterV2,
)
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import TableProperties
from pyiceberg.typedef import StructProtocol
from pyiceberg.types import StructType
from pyiceberg.utils.schema_conversion import AvroSchemaConversion

from icefloe.commit.caches import SharedCache

D = TypeVar("D", bound=StructProtocol)

# the header's own writer: the same for every Avro file
_HEADER_WRITER = construct_writer(META_SCHEMA)


@dataclass(frozen=True)
class Encoding:
    """What an Avro file of one schema needs besides its records: the file schema, the
    writer tree from the in-memory records to it, and the schema as the header's JSON."""

    file_schema: Schema
    schema_name: str
    writer: Writer
    json_schema: str

    @classmethod
    def build(cls, file_schema: Schema, record_schema: Schema, schema_name: str) -> Encoding:
        avro = AvroSchemaConversion().iceberg_to_avro(file_schema, schema_name=schema_name)
        return cls(
            file_schema, schema_name, resolve_writer(record_schema, file_schema), json.dumps(avro)
        )


# by format version and partition type, of which a pipeline has a handful: the bound only
# guards against a process that meets thousands of different specs
_ENCODINGS: SharedCache[Any, Encoding] = SharedCache(512)


def _encoding(key: Any, build: Callable[[], Encoding]) -> Encoding:
    """The encoding of ``key``, built once (two threads may both build it; either is kept)."""
    found = _ENCODINGS.get(key)
    if found is None:
        found = build()
        _ENCODINGS.put(key, found)
    return found


class PreparedAvroOutputFile(AvroOutputFile[D]):
    """pyiceberg's Avro file writer with its encoding handed in instead of built."""

    def __init__(
        self, output_file: OutputFile, encoding: Encoding, metadata: dict[str, str]
    ) -> None:
        # not super().__init__: building the writer tree is what this class saves
        self.output_file = output_file
        self.file_schema = encoding.file_schema
        self.schema_name = encoding.schema_name
        self.sync_bytes = os.urandom(SYNC_SIZE)
        self.writer = encoding.writer
        self.metadata = metadata
        self._json_schema = encoding.json_schema

    def _write_header(self) -> None:
        """The header pyiceberg writes (its codec name translated to Avro's), with the schema
        JSON and the header writer built once."""
        codec = self.metadata.get(AVRO_CODEC_KEY, TableProperties.WRITE_AVRO_COMPRESSION_DEFAULT)
        codec = CODEC_MAPPING_ICEBERG_TO_AVRO.get(codec) or codec
        meta = {**self.metadata, _SCHEMA_KEY: self._json_schema, AVRO_CODEC_KEY: codec}
        _HEADER_WRITER.write(self.encoder, AvroFileHeader(MAGIC, meta, self.sync_bytes))


class _PreparedManifest(ManifestWriter):
    """A manifest writer whose Avro encoding is built once per format version and
    partition type (the manifest entry schema depends on nothing else)."""

    def new_writer(self) -> AvroOutputFile[ManifestEntry]:
        partition_type: StructType = self._spec.partition_type(self._schema)
        key = ("manifest", self.version, partition_type)
        encoding = _encoding(
            key,
            lambda: Encoding.build(
                self._with_partition(self.version),
                self._with_partition(DEFAULT_READ_VERSION),
                "manifest_entry",
            ),
        )
        return PreparedAvroOutputFile[ManifestEntry](self._output_file, encoding, self._meta)


class ManifestWriterV1Prepared(_PreparedManifest, ManifestWriterV1):
    """pyiceberg's v1 manifest writer, its encoding reused."""


class ManifestWriterV2Prepared(_PreparedManifest, ManifestWriterV2):
    """pyiceberg's v2 manifest writer, its encoding reused."""


def write_manifest(
    format_version: int,
    spec: PartitionSpec,
    schema: Schema,
    output_file: OutputFile,
    snapshot_id: int,
    avro_compression: Any,
) -> ManifestWriter:
    """As pyiceberg's ``write_manifest``, with the encoding reused."""
    kind = {1: ManifestWriterV1Prepared, 2: ManifestWriterV2Prepared}.get(format_version)
    if kind is None:
        raise ValueError(f"Cannot write a manifest for table format version {format_version}")
    return kind(spec, schema, output_file, snapshot_id, avro_compression)


class _PreparedList(ManifestListWriter):
    """A manifest-list writer whose Avro encoding is built once per format version."""

    def __enter__(self) -> ManifestListWriter:
        version = self._format_version
        encoding = _encoding(
            ("list", version),
            lambda: Encoding.build(
                MANIFEST_LIST_FILE_SCHEMAS[version],
                MANIFEST_LIST_FILE_SCHEMAS[DEFAULT_READ_VERSION],
                "manifest_file",
            ),
        )
        self._writer = PreparedAvroOutputFile[ManifestFile](self._output_file, encoding, self._meta)
        self._writer.__enter__()
        return self


class ManifestListWriterV1Prepared(_PreparedList, ManifestListWriterV1):
    """pyiceberg's v1 manifest-list writer, its encoding reused."""


class ManifestListWriterV2Prepared(_PreparedList, ManifestListWriterV2):
    """pyiceberg's v2 manifest-list writer, its encoding reused."""


def write_manifest_list(
    format_version: int,
    output_file: OutputFile,
    snapshot_id: int,
    parent_snapshot_id: int | None,
    sequence_number: int | None,
    avro_compression: Any,
) -> ManifestListWriter:
    """As pyiceberg's ``write_manifest_list``, with the encoding reused."""
    if format_version == 1:
        return ManifestListWriterV1Prepared(
            output_file, snapshot_id, parent_snapshot_id, avro_compression
        )
    if format_version == 2 and sequence_number is not None:
        return ManifestListWriterV2Prepared(
            output_file, snapshot_id, parent_snapshot_id, sequence_number, avro_compression
        )
    raise ValueError(
        f"Cannot write a manifest list for table format version {format_version} "
        f"(sequence number {sequence_number})"
    )
