"""End to end on a private PostgreSQL server that is stopped and started in the middle of a
run: writers publishing real Parquet files, the core coordinator committing them to a real
Iceberg catalog. Every row must arrive exactly once, with one snapshot per table per cycle."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.plugins.manager import new_plugins
from icefloe.testing.fixtures import (
    assert_exactly_once,
    group_snapshots,
    make_sqlite_catalog,
    table_ids,
)
from icefloe.testing.harness import Batch, RowSource, lead
from icefloe_postgres import PostgresBackend
from icefloe_postgres.testing import PrivatePostgres, make_test_config
from icefloe_postgres.writer_channel import PostgresWriterChannel

TABLES = ("ns.orders", "ns.clicks")
WRITERS = ("writer-0", "writer-1")
BATCHES = 12
PAUSE_AT = 3  # writer-0's batch that is caught inside its transaction by the restart


def pause_inside_publish(
    monkeypatch: pytest.MonkeyPatch, writer_id: str, batch_seq: int
) -> tuple[threading.Event, threading.Event]:
    """Stop ``writer_id``'s publish of ``batch_seq`` inside its transaction, right after its
    offsets were taken: the most dangerous moment for the server to go away."""
    took, go = threading.Event(), threading.Event()
    real = PostgresWriterChannel._append

    def append(self: PostgresWriterChannel, conn: Any, events: Any, epoch: int, seq: Any) -> int:
        first = real(self, conn, events, epoch, seq)
        if self.writer_id == writer_id and seq == batch_seq and not took.is_set():
            took.set()
            go.wait(60)
        return first

    monkeypatch.setattr(PostgresWriterChannel, "_append", append)
    return took, go


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_server_restart_mid_run_neither_loses_nor_duplicates_rows(
    private_pg: PrivatePostgres,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    group = f"restart-{mode}"
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    source = RowSource.create(catalog, TABLES, rows_per_table=3)
    # files are written up front: the test is about the channel, not Parquet speed
    batches: dict[str, list[Batch]] = {
        w: [source.batch(w, seq) for seq in range(BATCHES)] for w in WRITERS
    }
    expected = {t: [i for w in WRITERS for b in batches[w] for i in b.ids[t]] for t in TABLES}
    config = make_test_config(
        private_pg.dsn, "icefloe", retry_timeout_s=60.0, poll_interval_s=0.2, pool_max_size=3
    )
    backend = PostgresBackend(config, group, lease_ttl_s=3.0)
    took, go = pause_inside_publish(monkeypatch, "writer-0", PAUSE_AT)
    clients = [WriterClient(backend.writer(w), group, w) for w in WRITERS]
    coordinator = Coordinator(
        group,
        backend.coordinator("c1"),
        catalog,
        CoordinatorSettings(commit_interval_s=0.3, commit_timeout_s=10.0, writer_timeout_s=600),
        coordinator_id="c1",
        plugins=new_plugins(autoload=False),
    )
    stop = threading.Event()
    errors: list[BaseException] = []
    published = Counter[str]()

    def run_coordinator() -> None:
        try:
            coordinator.run(stop)
        except BaseException as exc:
            errors.append(exc)

    def run_writer(client: WriterClient) -> None:
        try:
            for b in batches[client.writer_id]:
                assert client.publish(b.seq, b.files, b.positions) is True
                published[client.writer_id] += 1
                time.sleep(0.15)  # spread the batches over several commit cycles
        except BaseException as exc:
            errors.append(exc)

    coord_thread = threading.Thread(target=run_coordinator, daemon=True)
    writer_threads = [threading.Thread(target=run_writer, args=(c,), daemon=True) for c in clients]
    try:
        for c in clients:
            c.start()
        # lead and recover before the writers start: a recovery reads until the log is quiet
        lead(coordinator)
        coord_thread.start()
        for t in writer_threads:
            t.start()
        assert took.wait(60), "writer-0 never reached the paused batch"
        private_pg.stop(mode)  # kills the open transaction of writer-0, everyone's sessions
        go.set()  # writer-0 resumes against a dead connection and has to retry
        time.sleep(0.5)
        private_pg.start()
        for t in writer_threads:
            t.join(120)
        assert not any(t.is_alive() for t in writer_threads), "a writer hung"
        assert errors == []
        assert dict(published) == dict.fromkeys(WRITERS, BATCHES)
        deadline = time.monotonic() + 60
        while any(len(table_ids(catalog, t)) < len(expected[t]) for t in TABLES):
            assert not errors, errors
            assert time.monotonic() < deadline, {t: len(table_ids(catalog, t)) for t in TABLES}
            time.sleep(0.3)
    finally:
        go.set()
        stop.set()
        coord_thread.join(60)
        for c in clients:
            c.close()
        backend.close()
    assert errors == []
    for table in TABLES:
        assert_exactly_once(catalog, table, expected[table])
        snaps = group_snapshots(catalog, table, group)
        commit_ids = [
            s.summary.additional_properties["icefloe.commit-id"] for s in snaps if s.summary
        ]
        assert len(commit_ids) == len(set(commit_ids)), f"{table}: two snapshots in one cycle"
        assert len(snaps) >= 2, "the run spanned several cycles"
