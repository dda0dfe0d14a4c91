"""Bounded table metadata: the committer merges manifests and drops old metadata files when
the table asks for it, and ``doctor`` names the tables that do not; on a real SqlCatalog."""

from __future__ import annotations

import uuid
from pathlib import Path

from pyiceberg.catalog.sql import SqlCatalog

from icefloe.committer import IcebergCommitter, PendingFile, TableCommitRequest
from icefloe.config import config_from_dict
from icefloe.maintenance import (
    RECOMMENDED_TABLE_PROPERTIES,
    pipeline_table_advice,
    recommended_properties,
    table_property_advice,
)
from icefloe.testing.fixtures import (
    ROWS_SCHEMA,
    create_rows_table,
    sqlite_catalog_properties,
    table_ids,
    write_rows,
)

TABLE = "db.events"


def commit_cycles(catalog: SqlCatalog, cycles: int) -> None:
    """One real file and one commit per cycle, as a pipeline would."""
    committer = IcebergCommitter(catalog, "pipe")
    table = catalog.load_table(TABLE)
    for seq in range(cycles):
        [meta] = write_rows(table, [seq], "w1", seq)
        pending = PendingFile(meta, "w1", seq, "0", seq, str(table.metadata.table_uuid))
        result = committer.commit(
            TableCommitRequest(TABLE, str(uuid.uuid4()), (pending,), {"0": seq + 1}, {}, 1)
        )
        assert result.data_files == 1


def test_manifests_are_merged_when_the_table_enables_it(sqlite_catalog: SqlCatalog) -> None:
    create_rows_table(sqlite_catalog, TABLE)
    sqlite_catalog.load_table(TABLE).transaction().set_properties(
        {"commit.manifest-merge.enabled": "true", "commit.manifest.min-count-to-merge": "4"}
    ).commit_transaction()

    commit_cycles(sqlite_catalog, 12)

    table = sqlite_catalog.load_table(TABLE)
    snapshot = table.current_snapshot()
    assert snapshot is not None
    manifests = snapshot.manifests(table.io)
    assert len(manifests) < 4, f"{len(manifests)} manifests after 12 commits: none merged"
    assert table_ids(sqlite_catalog, TABLE) == list(range(12))  # merging lost nothing


def test_old_metadata_files_are_deleted_when_the_table_asks(sqlite_catalog: SqlCatalog) -> None:
    create_rows_table(sqlite_catalog, TABLE)
    sqlite_catalog.load_table(TABLE).transaction().set_properties(
        {
            "write.metadata.delete-after-commit.enabled": "true",
            "write.metadata.previous-versions-max": "3",
        }
    ).commit_transaction()

    commit_cycles(sqlite_catalog, 10)

    location = sqlite_catalog.load_table(TABLE).location().removeprefix("file://")
    kept = list((Path(location) / "metadata").glob("*.metadata.json"))
    assert len(kept) <= 4, f"{len(kept)} metadata files kept; previous-versions-max is 3"
    assert table_ids(sqlite_catalog, TABLE) == list(range(10))


def test_advice_names_each_missing_property_and_respects_explicit_values() -> None:
    assert table_property_advice("db.t", recommended_properties()) == []
    advice = table_property_advice("db.t", {"write.metadata.delete-after-commit.enabled": "false"})
    assert len(advice) == len(RECOMMENDED_TABLE_PROPERTIES) - 1
    assert all(a.startswith("table 'db.t': property ") for a in advice)
    assert any("commit.manifest-merge.enabled" in a and "set it to true" in a for a in advice)
    assert (
        recommended_properties({"write.metadata.previous-versions-max": "9"})[
            "write.metadata.previous-versions-max"
        ]
        == "9"
    )


def test_doctor_advice_covers_existing_pipeline_tables_only(tmp_path: Path) -> None:
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = SqlCatalog("doc", **props)
    catalog.create_namespace("db")
    catalog.create_table("db.bare", schema=ROWS_SCHEMA)
    catalog.create_table("db.good", schema=ROWS_SCHEMA, properties=recommended_properties())
    cfg = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "catalog": {"name": "doc", "properties": props},
            "tables": [{"name": "db.bare"}, {"name": "db.good"}, {"name": "db.missing"}],
        }
    )
    advice = pipeline_table_advice(cfg)
    assert len(advice) == len(RECOMMENDED_TABLE_PROPERTIES)
    assert all("'db.bare'" in a for a in advice)
