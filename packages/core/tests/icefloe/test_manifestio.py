"""icefloe's manifest and manifest-list writers reuse their Avro encoding, and write the
bytes pyiceberg's writers write: same entries, same header, same blocks. Real tables in a
SQLite catalog; the entries are those pyiceberg's own append wrote."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.io.pyarrow import PyArrowFileIO
from pyiceberg.manifest import (
    ManifestContent,
    ManifestEntry,
    ManifestFile,
    ManifestWriterV2,
    write_manifest,
    write_manifest_list,
)
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform, DayTransform, IdentityTransform
from pyiceberg.types import LongType, NestedField, StringType, TimestampType

from icefloe.commit import manifestio
from icefloe.commit.fastappend import delete_manifest
from icefloe.testing.fixtures import make_sqlite_catalog

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=False),
    NestedField(2, "name", StringType(), required=False),
    NestedField(3, "ts", TimestampType(), required=False),
)
SPECS = {
    "unpartitioned": PartitionSpec(),
    "partitioned": PartitionSpec(
        PartitionField(2, 1000, IdentityTransform(), "name"),
        PartitionField(1, 1001, BucketTransform(4), "id_bucket"),
        PartitionField(3, 1002, DayTransform(), "ts_day"),
    ),
}


@pytest.fixture(autouse=True)
def fixed_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both writers draw the file's sync marker from os.urandom: fixed here, so the files
    compare byte for byte."""
    monkeypatch.setattr(os, "urandom", lambda n: bytes(range(n)))


@pytest.fixture
def catalog(tmp_path: Path) -> SqlCatalog:
    return make_sqlite_catalog(tmp_path / "iceberg")


def appended(catalog: SqlCatalog, name: str, spec: PartitionSpec, version: int) -> Table:
    """A table with one snapshot of 30 rows over several partitions, written by pyiceberg."""
    catalog.create_namespace_if_not_exists("db")
    table = catalog.create_table(
        f"db.{name}", SCHEMA, partition_spec=spec, properties={"format-version": str(version)}
    )
    rows = pa.table(
        {
            "id": pa.array(range(30), pa.int64()),
            "name": pa.array([f"n{i % 3}" for i in range(30)]),
            "ts": pa.array(
                [datetime(2026, 11, 1 + i % 4, 12) for i in range(30)], pa.timestamp("us")
            ),
        }
    )
    table.append(rows)
    return table


def entries_of(table: Table) -> tuple[ManifestFile, list[ManifestEntry]]:
    snapshot = table.current_snapshot()
    assert snapshot is not None
    (manifest,) = snapshot.manifests(table.io)
    return manifest, manifest.fetch_manifest_entry(table.io, discard_deleted=False)


def written(path: Path, write: Any) -> bytes:
    write(PyArrowFileIO().new_output(str(path)))
    return path.read_bytes()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("codec", ["null", "deflate", "zstd"])
def test_a_manifest_and_its_list_are_the_bytes_pyiceberg_writes(
    catalog: SqlCatalog, tmp_path: Path, version: int, spec_name: str, codec: str
) -> None:
    table = appended(catalog, f"t_{spec_name}_v{version}", SPECS[spec_name], version)
    manifest, entries = entries_of(table)
    spec, schema = table.spec(), table.schema()
    assert len(entries) > (1 if spec_name == "partitioned" else 0)

    def manifest_with(factory: Any) -> Any:
        def write(out: Any) -> None:
            with factory(
                format_version=version,
                spec=spec,
                schema=schema,
                output_file=out,
                snapshot_id=manifest.added_snapshot_id,
                avro_compression=codec,
            ) as writer:
                for entry in entries:
                    writer.add_entry(entry)
            results.append(writer.to_manifest_file())

        return write

    results: list[ManifestFile] = []
    theirs = written(tmp_path / "theirs.avro", manifest_with(write_manifest))
    ours = written(tmp_path / "ours.avro", manifest_with(manifestio.write_manifest))
    assert ours == theirs
    # the same counts and bounds in the manifest-list entry, but for the path
    assert results[0].added_files_count == results[1].added_files_count == len(entries)
    assert results[0].partitions == results[1].partitions

    def list_with(factory: Any) -> Any:
        def write(out: Any) -> None:
            with factory(
                format_version=version,
                output_file=out,
                snapshot_id=manifest.added_snapshot_id,
                parent_snapshot_id=17,
                sequence_number=5,
                avro_compression=codec,
            ) as writer:
                writer.add_manifests([manifest, results[0]])

        return write

    theirs = written(tmp_path / "theirs-list.avro", list_with(write_manifest_list))
    ours = written(tmp_path / "ours-list.avro", list_with(manifestio.write_manifest_list))
    assert ours == theirs


class _PlainDeleteManifest(ManifestWriterV2):
    """What icefloe's delete manifest is, on pyiceberg's writer as it comes."""

    def content(self) -> ManifestContent:
        return ManifestContent.DELETES

    @property
    def _meta(self) -> dict[str, str]:
        return {**super()._meta, "content": "deletes"}


def entries_written(path: Path, kind: Any, table: Table, entries: list[ManifestEntry]) -> bytes:
    """The bytes of a manifest of ``entries`` written by writer class ``kind``."""

    def write(out: Any) -> None:
        with kind(table.spec(), table.schema(), out, 1, "null") as writer:
            for entry in entries:
                writer.add_entry(entry)

    return written(path, write)


def test_encodings_of_different_specs_do_not_mix(catalog: SqlCatalog, tmp_path: Path) -> None:
    """Manifests of two specs written in turn, each through the reused encoding of its own
    partition type: each equals pyiceberg's, and a delete manifest shares the data one's."""
    tables = {name: appended(catalog, f"mix_{name}", spec, 2) for name, spec in SPECS.items()}
    for turn, name in enumerate(["partitioned", "unpartitioned", "partitioned"]):
        table = tables[name]
        entries = entries_of(table)[1]
        ours = entries_written(
            tmp_path / f"o{turn}", manifestio.ManifestWriterV2Prepared, table, entries
        )
        theirs = entries_written(tmp_path / f"t{turn}", ManifestWriterV2, table, entries)
        assert ours == theirs, name
        ours = written(
            tmp_path / f"od{turn}",
            lambda out, t=table, e=entries: delete_manifest(
                t.spec(), t.schema(), out, 1, "null", e
            ),
        )
        theirs = entries_written(tmp_path / f"td{turn}", _PlainDeleteManifest, table, entries)
        assert ours == theirs, name


def test_unknown_format_versions_are_refused(tmp_path: Path) -> None:
    out = PyArrowFileIO().new_output(str(tmp_path / "x.avro"))
    with pytest.raises(ValueError, match="format version 3"):
        manifestio.write_manifest(3, PartitionSpec(), SCHEMA, out, 1, "null")
    with pytest.raises(ValueError, match="format version 2"):
        manifestio.write_manifest_list(2, out, 1, None, None, "null")
