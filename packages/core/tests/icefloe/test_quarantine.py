"""The quarantine table and the ``icefloe quarantine`` command, on a real SQLite catalog."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from typer.testing import CliRunner

from icefloe.cli.main import app
from icefloe.commit import quarantine as quarantine_module
from icefloe.commit.quarantine import (
    _SCHEMA,
    DEFAULT_QUARANTINE_TABLE,
    RETIRED,
    FailingTable,
    Quarantine,
    QuarantineEntry,
)
from icefloe.commit.versions import without_retries
from icefloe.errors import StaleFencingTokenError
from icefloe.testing.fixtures import (
    make_sqlite_catalog,
    quarantine_entry,
    sqlite_catalog_properties,
)

GROUP = "pipe-q"


def _entry(table: str, path: str, group: str = GROUP) -> QuarantineEntry:
    return quarantine_entry(group, table, path)


def test_entries_are_recorded_once_per_pipeline_table_and_path(sqlite_catalog: SqlCatalog) -> None:
    q = Quarantine(sqlite_catalog)
    assert q.list(GROUP) == []  # no table yet: nothing, and nothing created
    assert not sqlite_catalog.table_exists(q.identifier)
    first = [_entry("db.a", "/x/1"), _entry("db.a", "/x/2"), _entry("db.a", "/x/1")]
    assert [e.file_path for e in q.add(first)] == ["/x/1", "/x/2"]
    assert q.add([_entry("db.a", "/x/2"), _entry("db.b", "/x/2")]) == [_entry("db.b", "/x/2")]
    assert q.add([_entry("db.a", "/x/1", group="other")]) != []  # another pipeline's own
    assert q.paths(GROUP, "db.a") == {"/x/1", "/x/2"}
    assert [e.file_path for e in q.list(GROUP, "db.b")] == ["/x/2"]
    assert len(q.list(GROUP)) == 3
    assert q.list(GROUP)[0] == _entry("db.a", "/x/1")
    assert q.drop(GROUP, "db.a", "/x/1") == 1
    assert q.paths(GROUP, "db.a") == {"/x/2"}
    assert q.paths("other", "db.a") == {"/x/1"}


def test_retired_entries_stay_known_but_unlisted(sqlite_catalog: SqlCatalog) -> None:
    """A retired entry (a rollback's replay holds its records) is a tombstone: left out of the
    list and of maintain's protection, its path still known, so the file announced again is
    not quarantined twice. Retiring more paths later keeps the earlier tombstones."""
    q = Quarantine(sqlite_catalog)
    q.add([_entry("db.a", "/x/1"), _entry("db.a", "/x/2"), _entry("db.a", "/x/3")])
    assert q.retire(GROUP, "db.a", ["/x/1"], "replayed") == 1
    assert q.retire(GROUP, "db.a", ["/x/1", "/x/2"], "replayed") == 1
    assert [e.file_path for e in q.list(GROUP)] == ["/x/3"]
    retired = [e for e in q.list(GROUP, retired=True) if e.error_type == RETIRED]
    assert sorted(e.file_path for e in retired) == ["/x/1", "/x/2"]
    assert q.paths(GROUP, "db.a") == {"/x/1", "/x/2", "/x/3"}
    assert q.all_paths() == {"/x/3"}
    assert q.add([_entry("db.a", "/x/1")]) == []


def test_entries_keep_the_source_offsets_their_batch_reached(sqlite_catalog: SqlCatalog) -> None:
    q = Quarantine(sqlite_catalog)
    reached = {"a": {0: 12, 3: 4}, "b": {1: 7}}
    with_offsets = dataclasses.replace(_entry("db.a", "/x/1"), source_offsets=reached)
    q.add([with_offsets, _entry("db.a", "/x/2")])
    assert q.list(GROUP) == [with_offsets, _entry("db.a", "/x/2")]


def test_a_table_written_before_source_offsets_keeps_working(sqlite_catalog: SqlCatalog) -> None:
    """An existing quarantine table without the later columns is read as it is (they read as
    None), and its next write adds them; a writer that leaves them out still appends."""
    first = Schema(*(f for f in _SCHEMA.fields if f.name != "source_offsets"))
    sqlite_catalog.create_namespace("icefloe")
    old = sqlite_catalog.create_table(DEFAULT_QUARANTINE_TABLE, first)
    old_row = {k: v for k, v in dataclasses.asdict(_entry("db.a", "/x/0")).items()}
    del old_row["source_offsets"]
    old.append(pa.Table.from_pylist([old_row], schema=first.as_arrow()))
    q = Quarantine(sqlite_catalog)
    assert q.list(GROUP) == [_entry("db.a", "/x/0")]
    assert q.retire(GROUP, "db.a", ["/x/none"]) == 0
    reached = dataclasses.replace(_entry("db.a", "/x/1"), source_offsets={"t": {0: 5}})
    assert q.add([reached, _entry("db.a", "/x/0")]) == [reached]
    upgraded = sqlite_catalog.load_table(DEFAULT_QUARANTINE_TABLE)
    assert "source_offsets" in upgraded.schema().column_names
    older_row = {**old_row, "file_path": "/x/2"}  # a coordinator of the first schema
    upgraded.append(pa.Table.from_pylist([older_row], schema=first.as_arrow()))
    assert [(e.file_path, e.source_offsets) for e in q.list(GROUP)] == [
        ("/x/0", None),
        ("/x/1", {"t": {0: 5}}),
        ("/x/2", None),
    ]


def test_failing_marks_are_kept_per_pipeline_and_table(sqlite_catalog: SqlCatalog) -> None:
    q = Quarantine(sqlite_catalog)
    assert q.failing(GROUP) == {}
    mark = FailingTable(failures=10, error="OSError: " + "x" * 5000, since_ms=1, marked_ms=2)
    q.mark_failing(GROUP, "db.a", mark)
    q.mark_failing(f"{GROUP}.x", "db.a", mark)  # a pipeline whose name extends this one's
    assert q.failing(GROUP) == {"db.a": dataclasses.replace(mark, error=mark.error[:2000])}
    assert list(q.failing(f"{GROUP}.x")) == ["db.a"]
    q.clear_failing(GROUP, "db.a")
    q.clear_failing(GROUP, "db.b")  # never marked: nothing to do
    assert q.failing(GROUP) == {}
    assert list(q.failing(f"{GROUP}.x")) == ["db.a"]


def test_cli_lists_and_drops_entries(tmp_path: Path) -> None:
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    Quarantine(catalog).add([_entry("db.a", "/x/1"), _entry("db.b", "/x/2")])
    config = tmp_path / "pipeline.toml"
    config.write_text(
        f'name = "{GROUP}"\n[source]\ntopics = ["t"]\n[[tables]]\nname = "db.a"\n'
        f'[catalog]\nname = "{catalog.name}"\n'
        f'[catalog.properties]\nuri = "{props["uri"]}"\nwarehouse = "{props["warehouse"]}"\n'
    )
    runner = CliRunner()
    listed = runner.invoke(app, ["quarantine", "list", "--config", str(config), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["table_name"], r["file_path"], r["error_type"]) for r in rows] == [
        ("db.a", "/x/1", "FileOutsideTableError"),
        ("db.b", "/x/2", "FileOutsideTableError"),
    ]
    refused = runner.invoke(app, ["quarantine", "drop", "--config", str(config)])
    assert refused.exit_code != 0  # dropping everything needs --all
    dropped = runner.invoke(app, ["quarantine", "drop", "-c", str(config), "--table", "db.a"])
    assert dropped.exit_code == 0, dropped.output
    assert "dropped 1" in dropped.stdout
    text = runner.invoke(app, ["quarantine", "list", "--config", str(config)])
    assert text.exit_code == 0
    assert "/x/2" in text.stdout
    assert "/x/1" not in text.stdout
    assert Quarantine(catalog).paths(GROUP, "db.b") == {"/x/2"}


def test_quarantine_settings_come_from_the_coordination_section() -> None:
    from icefloe.config import config_from_dict
    from icefloe.coordination.coordinator import CoordinatorSettings
    from icefloe.errors import ConfigError

    base = {"name": "p", "source": {"topics": ["t"]}, "tables": [{"name": "db.t"}]}
    cfg = config_from_dict(
        {
            **base,
            "coordination": {
                "quarantine_table": "ops.refused",
                "quarantine_after_failures": 3,
                "table_retry_base_s": 0.5,
                "table_retry_max_s": 20,
            },
        }
    )
    settings = CoordinatorSettings.from_config(cfg.coordination)
    assert settings.quarantine_table == "ops.refused"
    assert settings.quarantine_after_failures == 3
    assert (settings.table_retry_base_s, settings.table_retry_max_s) == (0.5, 20.0)
    with pytest.raises(ConfigError, match=r"coordination\.quarantine_table"):
        config_from_dict({**base, "coordination": {"quarantine_table": "no-namespace"}})


def test_a_deposed_leaders_writes_after_its_heirs_fence_are_refused(
    sqlite_catalog: SqlCatalog,
) -> None:
    """Leader 1 is deposed; leader 2 raises its fence before reading the quarantine. Leader
    1's entries and retirements are refused and change nothing, as is its fence raised
    again; leader 2's writes land. Another channel's tokens (a drained one) fence nothing."""
    q = Quarantine(sqlite_catalog)
    q.fence(GROUP, 1, "ch")
    assert q.add([_entry("db.a", "/x/1")], token=1, channel_id="ch") == [_entry("db.a", "/x/1")]
    q.fence(GROUP, 2, "ch")
    q.fence(GROUP, 2, "ch")  # raised already: nothing to do
    with pytest.raises(StaleFencingTokenError):
        q.add([_entry("db.a", "/x/2")], token=1, channel_id="ch")
    with pytest.raises(StaleFencingTokenError):
        q.retire(GROUP, "db.a", ["/x/1"], "replayed", token=1, channel_id="ch")
    with pytest.raises(StaleFencingTokenError):
        q.fence(GROUP, 1, "ch")
    assert [(e.file_path, e.error_type) for e in q.list(GROUP, retired=True)] == [
        ("/x/1", "FileOutsideTableError")
    ]
    assert q.add([_entry("db.a", "/x/3")], token=2, channel_id="ch") == [_entry("db.a", "/x/3")]
    assert q.retire(GROUP, "db.a", ["/x/1"], "replayed", token=2, channel_id="ch") == 1
    assert q.add([_entry("db.a", "/x/4", group="other")], token=1, channel_id="ch") != []
    q.fence(GROUP, 1, "new")  # the pipeline moved to another channel, whose tokens restart
    assert q.add([_entry("db.a", "/x/5")], token=1, channel_id="new") != []
    assert q.paths(GROUP, "db.a") == {"/x/1", "/x/3", "/x/5"}


def test_a_write_planned_before_the_fence_fails_rather_than_landing(
    sqlite_catalog: SqlCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the fence's empty snapshot closes: the deposed leader checked the token (its
    own), then the heir raised its fence, then the deposed leader's append reached the
    catalog. Planned on the version before the fence, it fails; planned again it finds the
    heir's token and is refused. Any append of a version read before a fence fails."""
    q = Quarantine(sqlite_catalog)
    q.fence(GROUP, 1, "ch")
    heir = Quarantine(sqlite_catalog)
    planned = quarantine_module._to_arrow

    def heir_fences_meanwhile(table: Table, entries: Iterable[QuarantineEntry]) -> pa.Table:
        heir.fence(GROUP, 2, "ch")  # after the zombie's check, before its commit
        return planned(table, entries)

    monkeypatch.setattr(quarantine_module, "_to_arrow", heir_fences_meanwhile)
    with pytest.raises(StaleFencingTokenError):
        q.add([_entry("db.a", "/x/1")], token=1, channel_id="ch")
    monkeypatch.undo()
    assert q.list(GROUP) == []
    stale = without_retries(sqlite_catalog.load_table(q.identifier))
    heir.fence(GROUP, 3, "ch")
    with pytest.raises(CommitFailedException):
        stale.append(planned(stale, [_entry("db.a", "/x/2")]))
    assert heir.add([_entry("db.a", "/x/3")], token=3, channel_id="ch") != []  # the heir's lands
    assert heir.paths(GROUP, "db.a") == {"/x/3"}
