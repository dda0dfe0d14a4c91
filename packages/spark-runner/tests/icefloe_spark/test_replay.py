"""The driver's replay of a rolled-back table (icefloe_spark.replay), without Spark: a real
Tansu broker, a real SQLite catalog, the reference channel and a real coordinator. Rows are
read back with pyiceberg."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog, load_catalog

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.commit.rollback import Rollback
from icefloe.config import PipelineConfig, config_from_dict
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.errors import RollbackNotReplayableError
from icefloe.testing.fixtures import (
    EVENTS_SCHEMA,
    EVENTS_SPEC,
    assert_exactly_once,
    sqlite_catalog_properties,
    table_ids,
)
from icefloe.testing.harness import lead, wait_pending
from icefloe.testing.memory import MemoryBackend, MemoryServer
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.options import SourceOptions, source_options
from icefloe_spark.kafka.planning import KafkaInputPartition
from icefloe_spark.kafka.reading import read_range
from icefloe_spark.replay import RollbackWatcher, replay
from icefloe_spark.sink.tables import TableResolver
from icefloe_spark.sink.task import write_task

A, B = "db.rolled", "db.bystander"
PROBE = {"probeHighWatermark": "true", "pollTimeoutMs": "10000"}


def routed(table: str, ids: range) -> list[int]:
    return [i for i in ids if (i % 3 < 2) == (table == A)]


class Scene:
    """A topic of 30 JSON records (one partition), tables A (kinds a, b) and B (kind c), and
    a pipeline that committed A twice: offsets [0, 10) and [10, 30). With ``foreign_first``
    another writer appended id 1000 to A before the pipeline's first commit."""

    def __init__(
        self,
        broker: EmbeddedKafkaBroker,
        tmp: Path,
        produce: Any,
        topic: str,
        foreign_first: bool = False,
    ) -> None:
        self.group = f"replay-{uuid.uuid4().hex[:8]}"
        props = {"type": "sql", **sqlite_catalog_properties(tmp / "iceberg")}
        self.catalog: Catalog = load_catalog("replay", **props)
        self.catalog.create_namespace("db")
        for name in (A, B):
            self.catalog.create_table(name, schema=EVENTS_SCHEMA, partition_spec=EVENTS_SPEC)
        self.data: dict[str, Any] = {
            "name": self.group,
            "source": {
                "bootstrap_servers": broker.bootstrap_servers,
                "topics": [topic],
                "reader_options": PROBE,
            },
            "tables": [
                {"name": A, "route_field": "kind", "route_values": ["a", "b"]},
                {"name": B, "route_field": "kind", "route_values": ["c"]},
            ],
            "catalog": {"name": "replay", "properties": props},
            "coordination": {"backend": "memory"},
        }
        self.topic = topic
        values = [
            json.dumps({"id": i, "name": f"n{i}", "kind": "abc"[i % 3]}).encode() for i in range(30)
        ]
        produce(topic, values, partition=0)
        self.committer = IcebergCommitter(self.catalog, self.group)
        self.foreign: int | None = None
        if foreign_first:
            row = {"id": [1000], "name": ["x"], "kind": ["a"]}
            loaded = self.catalog.load_table(A)
            loaded.append(pa.table(row, schema=loaded.schema().as_arrow()))
            self.foreign = loaded.refresh().metadata.current_snapshot_id
        self.snapshots = [self.commit(0, 10, seq=0), self.commit(10, 30, seq=1)]

    @property
    def config(self) -> PipelineConfig:
        return config_from_dict(self.data)

    def commit(self, start: int, end: int, seq: int) -> int:
        """What the pipeline does for source offsets [start, end): A's rows, committed."""
        options = SourceOptions.parse(source_options(self.config))
        part = KafkaInputPartition(self.topic, 0, start, end)
        data = pa.Table.from_batches(list(read_range(options, part)))
        tables, converter = TableResolver(self.catalog, self.config).prepare(data)
        out = write_task(data, tables, converter, only=A)
        # announced on another channel than the test's: no channel positions to record
        files = tuple(PendingFile(m, "live", seq, "0", seq) for m in out.files[A])
        result = self.committer.commit(
            TableCommitRequest(A, f"c{seq}", files, {}, {self.topic: {0: end}}, 1)
        )
        assert result.snapshot_id is not None
        return result.snapshot_id

    def roll_back(self, snapshot_id: int) -> Rollback:
        rollback = self.committer.roll_back(A, snapshot_id)
        assert rollback is not None
        return rollback


@pytest.fixture
def make_scene(
    kafka_broker: EmbeddedKafkaBroker,
    tmp_path: Path,
    produce: Any,
    new_topic: Callable[..., str],
) -> Callable[..., Scene]:
    def make(foreign_first: bool = False) -> Scene:
        return Scene(kafka_broker, tmp_path, produce, new_topic(partitions=1), foreign_first)

    return make


@pytest.fixture
def scene(make_scene: Callable[..., Scene]) -> Scene:
    return make_scene()


@pytest.fixture
def backend(scene: Scene) -> MemoryBackend:
    return MemoryBackend(MemoryServer(), scene.group)


def commit_cycle(scene: Scene, backend: MemoryBackend, files: int) -> None:
    """A real coordinator reads the channel and runs one cycle."""
    coordinator = Coordinator(
        scene.group,
        backend.coordinator("c"),
        scene.catalog,
        CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=3600.0),
        coordinator_id="c",
    )
    try:
        lead(coordinator)
        wait_pending(coordinator, files)
        assert not coordinator.commit_now().failed
    finally:
        coordinator.close()


def reader_options(scene: Scene) -> dict[str, str]:
    return source_options(scene.config)


def test_replay_puts_the_rolled_back_rows_back_once_even_when_noticed_twice(
    scene: Scene, backend: MemoryBackend
) -> None:
    """Replayed twice before its commit (a second driver, or a retry after a crash between
    publish and commit): the same batch key, so the rows land once; B gets nothing."""
    rollback = scene.roll_back(scene.snapshots[0])
    assert sorted(table_ids(scene.catalog, A)) == routed(A, range(10))
    records = replay(scene.config, scene.catalog, backend, rollback, reader_options(scene))
    assert records == len(routed(A, range(10, 30)))
    again = replay(scene.config, scene.catalog, backend, rollback, reader_options(scene))
    assert again == records
    commit_cycle(scene, backend, 1)
    assert_exactly_once(scene.catalog, A, routed(A, range(30)))
    assert scene.catalog.load_table(B).current_snapshot() is None
    assert scene.committer.rollback(A) is None


def test_rollback_before_the_first_commit_replays_from_the_start(
    make_scene: Callable[..., Scene],
) -> None:
    """Rolled back to another writer's snapshot made before the pipeline's first commit: the
    replay starts where the pipeline began, the broker's earliest offset under
    starting_offsets earliest."""
    scene = make_scene(foreign_first=True)
    assert scene.foreign is not None
    rollback = scene.roll_back(scene.foreign)
    assert rollback.restored_snapshot_id is None
    backend = MemoryBackend(MemoryServer(), scene.group)
    replay(scene.config, scene.catalog, backend, rollback, reader_options(scene))
    commit_cycle(scene, backend, 1)
    assert_exactly_once(scene.catalog, A, [1000, *routed(A, range(30))])


def test_watcher_replays_each_rollback_once_and_refuses_keyed_tables(
    scene: Scene, backend: MemoryBackend
) -> None:
    scene.roll_back(scene.snapshots[0])
    watcher = RollbackWatcher(scene.config, scene.catalog, backend, reader_options(scene))
    assert [r.table for r in watcher.check()] == [A]
    assert watcher.check() == []  # published already: not read again every interval
    commit_cycle(scene, backend, 1)
    assert_exactly_once(scene.catalog, A, routed(A, range(30)))

    scene.data["tables"][0].update({"mode": "upsert", "id_columns": ["id"]})
    scene.roll_back(scene.snapshots[0])
    keyed = RollbackWatcher(scene.config, scene.catalog, backend, reader_options(scene))
    assert keyed.check() == []
    rollback = scene.committer.rollback(A)
    assert rollback is not None
    with pytest.raises(RollbackNotReplayableError, match=r"upsert mode.*--no-replay"):
        replay(scene.config, scene.catalog, backend, rollback, reader_options(scene))


def test_unknown_start_is_refused(make_scene: Callable[..., Scene]) -> None:
    """starting_offsets latest: where the pipeline began reading is not recorded."""
    scene = make_scene(foreign_first=True)
    assert scene.foreign is not None
    rollback = scene.roll_back(scene.foreign)
    scene.data["source"]["starting_offsets"] = "latest"
    backend = MemoryBackend(MemoryServer(), scene.group)
    with pytest.raises(RollbackNotReplayableError, match=r"records no offset.*--no-replay"):
        replay(scene.config, scene.catalog, backend, rollback, reader_options(scene))
