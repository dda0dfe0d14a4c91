"""The core coordinator and writer client over Redis, committing real Parquet files to a real
SqlCatalog: rows counted against what was published, one snapshot per table per cycle."""

from __future__ import annotations

import time
from pathlib import Path

from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.events import SourcePosition
from icefloe.testing.fixtures import (
    assert_exactly_once,
    create_rows_table,
    group_snapshots,
    make_sqlite_catalog,
    write_rows,
)

TABLES = ("ns.a", "ns.b")


def _lead(coordinator: Coordinator) -> None:
    deadline = time.monotonic() + 20
    while not coordinator.is_leader:
        assert time.monotonic() < deadline, "the coordinator never got the lease"
        coordinator.step(0.2)


def _read(coordinator: Coordinator, files: dict[str, int]) -> None:
    """Step until the coordinator has read the published files (a cycle commits what it has
    read when it starts)."""
    deadline = time.monotonic() + 20
    while coordinator.pending_files() != files:
        assert time.monotonic() < deadline, f"read {coordinator.pending_files()}, want {files}"
        coordinator.step(0.2)


def test_cycles_commit_every_row_once_with_one_snapshot_per_table(
    make_backend, group_id: str, tmp_path: Path
) -> None:
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    tables = {name: create_rows_table(catalog, name) for name in TABLES}
    backend = make_backend(lease_ttl_s=5.0)
    writers = [WriterClient(backend.writer(f"w{i}"), group_id, f"w{i}") for i in range(2)]
    for w in writers:
        w.start()
    settings = CoordinatorSettings(commit_interval_s=3600, commit_timeout_s=20)
    coordinator = Coordinator(group_id, backend.coordinator("c1"), catalog, settings, "c1")
    expected: dict[str, list[int]] = {name: [] for name in TABLES}
    next_id = 0
    try:
        _lead(coordinator)
        cycles = 3
        for cycle in range(cycles):
            for wi, w in enumerate(writers):
                for b in range(2):
                    seq = cycle * 2 + b
                    files = {}
                    for name, table in tables.items():
                        ids = list(range(next_id, next_id + 5))
                        next_id += 5
                        expected[name].extend(ids)
                        files[name] = write_rows(table, ids, w.writer_id, seq)
                    pos = [SourcePosition("src", wi, seq + 1, 1_000 * (seq + 1))]
                    assert w.publish(seq, files, pos) is True
            _read(coordinator, dict.fromkeys(TABLES, 4))
            result = coordinator.commit_now()
            assert result.complete, "every live writer answers StartCommit"
            assert not result.failed
            assert sorted(r.table for r in result.tables if r.snapshot_id) == list(TABLES)
            assert all(r.data_files == 4 and r.records == 20 for r in result.tables)
            assert result.valid_through_ms == 1_000 * (cycle * 2 + 2)

        # a replayed batch (Spark re-running a batch after a crash) adds nothing
        replay = {"ns.a": write_rows(tables["ns.a"], [999_999], "w0", 0)}
        assert writers[0].publish(0, replay, []) is False
        coordinator.step(0.5)
        assert coordinator.pending_files() == {}

        for name in TABLES:
            assert_exactly_once(catalog, name, expected[name])
            assert len(group_snapshots(catalog, name, group_id)) == cycles
    finally:
        coordinator.close()
        for w in writers:
            w.close()
    # the committed events were trimmed from the stream
    assert backend.client.xlen(backend.keys.events) == 0


def test_a_new_leader_resumes_from_the_stored_position(
    make_backend, group_id: str, tmp_path: Path
) -> None:
    """A leader that stops after committing hands over: the successor re-reads from the
    stored position and commits only what came later."""
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    table = create_rows_table(catalog, "ns.a")
    backend = make_backend(lease_ttl_s=5.0)
    writer = WriterClient(backend.writer("w"), group_id, "w")
    writer.start()
    settings = CoordinatorSettings(commit_interval_s=3600, commit_timeout_s=20)
    first = Coordinator(group_id, backend.coordinator("c1"), catalog, settings, "c1")
    try:
        _lead(first)
        writer.publish(0, {"ns.a": write_rows(table, range(10), "w", 0)}, [])
        _read(first, {"ns.a": 1})
        assert first.commit_now().tables[0].records == 10
        writer.publish(1, {"ns.a": write_rows(table, range(10, 25), "w", 1)}, [])
        first.close()  # releases the lease: the second takes over at once

        second = Coordinator(group_id, backend.coordinator("c2"), catalog, settings, "c2")
        try:
            _lead(second)  # recovery re-reads from the stored position
            assert second.pending_files() == {"ns.a": 1}
            assert second.commit_now().tables[0].records == 15
        finally:
            second.close()
        assert_exactly_once(catalog, "ns.a", list(range(25)))
        snaps = group_snapshots(catalog, "ns.a", group_id)
        tokens = [
            int(s.summary.additional_properties["icefloe.fencing-token"])
            for s in snaps
            if s.summary
        ]
        assert len(tokens) == 2
        assert tokens[0] < tokens[1]
    finally:
        writer.close()
