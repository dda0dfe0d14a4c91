"""Quarantine over Redis: a file the table refuses is recorded once, the rest committed, and a
coordinator that crashes before storing the position neither loses the record nor quarantines
the file again after the restart (issue 10 §2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from icefloe.commit.quarantine import Quarantine
from icefloe.coordination.coordinator import (
    Coordinator,
    CoordinatorHooks,
    CoordinatorSettings,
    CycleResult,
)
from icefloe.coordination.writer import WriterClient
from icefloe.testing.fixtures import assert_exactly_once, make_sqlite_catalog
from icefloe.testing.harness import RowSource, SimulatedCrash, lead, wait_pending

TABLES = ("ns.a", "ns.b")
SETTINGS = CoordinatorSettings(commit_interval_s=3600, commit_timeout_s=20)


def _crash_after_commits(_: CycleResult) -> None:
    raise SimulatedCrash


def test_quarantine_survives_a_coordinator_crash_before_the_position_is_stored(
    make_backend, group_id: str, tmp_path: Path
) -> None:
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    source = RowSource.create(catalog, TABLES)
    backend = make_backend(lease_ttl_s=1.0)
    writer = WriterClient(backend.writer("w"), group_id, "w")
    writer.start()
    try:
        good = source.batch("w", 0)
        stray = source.batch("w", 1).files["ns.b"]  # ns.b's files, announced for ns.a
        files = {t: list(fs) for t, fs in good.files.items()}
        files["ns.a"] += stray
        assert writer.publish(0, files, good.positions)
        for t, ids in good.ids.items():
            source.expected.setdefault(t, []).extend(ids)

        doomed = Coordinator(
            group_id,
            backend.coordinator("doomed"),
            catalog,
            SETTINGS,
            "doomed",
            hooks=CoordinatorHooks(after_iceberg_commits=_crash_after_commits),
        )
        lead(doomed)
        wait_pending(doomed, good.file_count + len(stray))
        with pytest.raises(SimulatedCrash):
            doomed.commit_now()  # quarantined and committed; the position was not stored
        assert backend.coordinator("probe").stored_position() is None
        quarantine = Quarantine(catalog)
        assert sorted(e.file_path for e in quarantine.list(group_id)) == sorted(
            f.path for f in stray
        )

        heir = Coordinator(group_id, backend.coordinator("heir"), catalog, SETTINGS, "heir")
        lead(heir, timeout=30)  # the doomed lease expires first
        # the re-read skips the quarantined files and what the tables already hold
        assert heir.pending_files() == {}
        result = heir.commit_now()
        assert result.failed == {}
        assert result.quarantined == {}
        assert heir.quarantined_files == 0
        entries = quarantine.list(group_id)
        assert sorted(e.file_path for e in entries) == sorted(f.path for f in stray)
        assert {(e.table_name, e.error_type) for e in entries} == {
            ("ns.a", "FileOutsideTableError")
        }
        assert backend.coordinator("probe2").stored_position() == heir.read_position
        for t in TABLES:
            assert_exactly_once(catalog, t, source.expected[t])
        heir.close()
    finally:
        writer.close()
