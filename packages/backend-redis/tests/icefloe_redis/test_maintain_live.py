"""``icefloe maintain`` next to a live pipeline on Redis, with real Parquet files in a real
SqlCatalog: many writer ids come and go (their watermarks are retired to a side file), one
batch is published and not committed yet, then maintain expires snapshots and removes orphans.
It must keep what the dedupe rule needs (the group's newest snapshot, the retired writers' file)
and every file the uncommitted batch announces; the pipeline then commits that batch, and a
retired writer replaying an old batch through a new channel is not committed twice (rows
counted with a pyiceberg scan)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.dedupe import RETIRED_KEY, WATERMARKS_KEY
from icefloe.commit.retirement import RETIRE_AT
from icefloe.commit.summary import state_property
from icefloe.config import config_from_dict
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.ops.maintenance import maintain
from icefloe.plugins.manager import new_plugins
from icefloe.testing.fixtures import (
    assert_exactly_once,
    group_snapshots,
    make_sqlite_catalog,
    sqlite_catalog_properties,
    write_rows,
)
from icefloe.testing.harness import RowSource, lead, wait_pending
from icefloe_redis import RedisConfig

from .conftest import MakeBackend

TABLE = "live.events"
CYCLES, PER_CYCLE = 6, 8  # 48 writer ids, each alive for one cycle
CATALOG = "icefloe_test"


def _age_everything(location: str, seconds: float) -> None:
    stamp = time.time() - seconds
    for path in Path(location.removeprefix("file://")).rglob("*"):
        if path.is_file():
            os.utime(path, (stamp, stamp))


def _coordinator(backend, catalog, name: str) -> Coordinator:
    settings = CoordinatorSettings(
        commit_interval_s=3600.0, commit_timeout_s=20.0, writer_timeout_s=1.0
    )
    return Coordinator(
        backend.group_id,
        backend.coordinator(name),
        catalog,
        settings,
        coordinator_id=name,
        plugins=new_plugins(autoload=False),
    )


def test_maintain_beside_a_live_pipeline_keeps_what_dedupe_and_pending_batches_need(
    make_backend: MakeBackend, config: RedisConfig, group_id: str, tmp_path: Path
) -> None:
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = make_sqlite_catalog(tmp_path / "iceberg", CATALOG)
    source = RowSource.create(catalog, [TABLE])
    backend = make_backend(lease_ttl_s=5.0)
    coordinator = _coordinator(backend, catalog, "c1")
    tail = WriterClient(backend.writer("tail"), group_id, "tail")
    try:
        lead(coordinator)
        for cycle in range(CYCLES):
            writers = [
                WriterClient(backend.writer(f"q{cycle}-{i}"), group_id, f"q{cycle}-{i}")
                for i in range(PER_CYCLE)
            ]
            for w in writers:
                w.start()
            files = sum(source.publish(w, 0).file_count for w in writers)
            wait_pending(coordinator, files)
            [result] = coordinator.commit_now().tables
            assert result.data_files == files
            for w in writers:
                w.close()
            time.sleep(1.2)  # past writer_timeout_s: the next cycle no longer waits for them

        table = catalog.load_table(TABLE)
        [*_, newest] = group_snapshots(catalog, TABLE, group_id)
        summary = newest.summary.additional_properties  # type: ignore[union-attr]
        assert len(json.loads(summary[WATERMARKS_KEY])) < PER_CYCLE + RETIRE_AT
        retired_file = summary[RETIRED_KEY].removeprefix("file://")
        assert Path(retired_file).exists()

        tail.start()
        pending = source.publish(tail, 0)  # published, not committed yet
        wait_pending(coordinator, pending.file_count)
        [stray] = write_rows(table, [999_999], "crashed-task", 0)  # never announced
        _age_everything(table.location(), 10 * 86_400)

        cfg = config_from_dict(
            {
                "name": group_id,
                "source": {"topics": ["t"]},
                "catalog": {"name": CATALOG, "properties": props},
                "tables": [{"name": TABLE}],
                "coordination": {
                    "backend": "redis",
                    "redis": {"url": config.url, "key_prefix": config.key_prefix},
                },
            }
        )
        lines = maintain(cfg, expire_older_than_s=0, retain_last=0, orphans_older_than_s=86_400)

        table = catalog.load_table(TABLE)
        assert f"{TABLE}: expire {CYCLES - 1} snapshot(s)" in lines[0], lines
        assert table.metadata.snapshot_by_id(newest.snapshot_id) is not None  # dedupe keeps it
        assert Path(retired_file).exists(), "maintain deleted the retired writers' watermarks"
        for f in pending.files[TABLE]:
            assert Path(f.path.removeprefix("file://")).exists(), f.path
        assert not Path(stray.path.removeprefix("file://")).exists()
        assert f"kept {pending.file_count} announced by uncommitted batches" in lines[1], lines

        # the pipeline goes on: the pending batch is committed once
        [result] = coordinator.commit_now().tables
        assert result.data_files == pending.file_count
        assert_exactly_once(catalog, TABLE, source.expected[TABLE])
        old_channel = coordinator.channel.channel_id()
    finally:
        tail.close()
        coordinator.close()

    # the pipeline moves to a new channel (drained), where the old channel's record of
    # published batch keys is gone: a retired writer replays its batch 0 with new files
    assert IcebergCommitter(catalog, group_id).mark_drained(TABLE, old_channel)
    kept = json.loads(
        catalog.load_table(TABLE).metadata.properties[state_property(group_id, "main")]
    )
    assert "q0-0" not in json.loads(kept["summary"][WATERMARKS_KEY])  # retired, not forgotten
    moved = make_backend(cfg=RedisConfig(url=config.url, key_prefix=f"{config.key_prefix}-b"))
    coordinator = _coordinator(moved, catalog, "c2")
    back = WriterClient(moved.writer("q0-0"), group_id, "q0-0")
    try:
        back.start()
        lead(coordinator)
        replay = source.batch("q0-0", 0, source.expected_ids_of("q0-0", 0))
        assert back.publish(0, replay.files, replay.positions)  # the new channel takes it
        fresh = source.publish(back, 1)
        coordinator.step(0.5)
        wait_pending(coordinator, fresh.file_count)  # the replay is skipped while reading
        [result] = coordinator.commit_now().tables
        assert result.data_files == fresh.file_count
        assert_exactly_once(catalog, TABLE, source.expected[TABLE])
    finally:
        back.close()
        coordinator.close()
