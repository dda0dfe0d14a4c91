"""The driver's replay of a rolled-back table (icefloe_spark.replay), without Spark: a real
Tansu broker, a real SQLite catalog, the reference channel and a real coordinator. Rows are
read back with pyiceberg."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections import Counter
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
from icefloe.coordination.writer import WriterClient
from icefloe.errors import RollbackNotReplayableError
from icefloe.plugins.manager import Plugins, new_plugins
from icefloe.records.datafiles import write_data_files
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
from icefloe_spark.sink.tables import TableResolver, ensure_dead_letter_table
from icefloe_spark.sink.task import write_task

A, B, DEAD, DYN = "db.rolled", "db.bystander", "db.dead_letters", "dyn.a"
PROBE = {"probeHighWatermark": "true", "pollTimeoutMs": "10000"}


def routed(table: str, ids: range) -> list[int]:
    return [i for i in ids if (i % 3 < 2) == (table == A)]


class Scene:
    """A topic of 30 JSON records (one partition), tables A (kinds a, b) and B (kind c), and
    a pipeline that committed A twice: offsets [0, 10) and [10, 30). With ``foreign_first``
    another writer appended id 1000 to A before the pipeline's first commit. With
    ``dead_letter`` no table takes kind c: those records went to the dead-letter table DEAD,
    committed twice as well. With ``dynamic`` no table is listed: ``[dynamic_tables]`` routes
    each record to ``dyn.<kind>``, and the pipeline committed DYN (kind a) instead of A."""

    def __init__(
        self,
        broker: EmbeddedKafkaBroker,
        tmp: Path,
        produce: Any,
        topic: str,
        foreign_first: bool = False,
        dead_letter: bool = False,
        dynamic: bool = False,
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
        if dynamic:
            self.data["tables"] = []
            self.data["dynamic_tables"] = {
                "route_field": "kind",
                "namespace": "dyn",
                "auto_create": True,
            }
        if dead_letter:
            self.data["tables"] = self.data["tables"][:1]
            self.data["errors"] = {"policy": "dead_letter", "dead_letter_table": DEAD}
            ensure_dead_letter_table(self.catalog, self.config)
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
        self.rolled = DYN if dynamic else A
        self.snapshots = [
            self.commit(0, 10, seq=0, table=self.rolled),
            self.commit(10, 30, seq=1, table=self.rolled),
        ]
        if dead_letter:
            self.dead_letter_snapshots = [
                self.commit(0, 10, seq=0, table=DEAD),
                self.commit(10, 30, seq=1, table=DEAD),
            ]

    @property
    def config(self) -> PipelineConfig:
        return config_from_dict(self.data)

    def commit(self, start: int, end: int, seq: int, table: str = A) -> int:
        """What the pipeline does for source offsets [start, end): ``table``'s rows (the
        dead-letter table's: the records set aside under ``[errors]``), committed."""
        options = SourceOptions.parse(source_options(self.config))
        part = KafkaInputPartition(self.topic, 0, start, end)
        data = pa.Table.from_batches(list(read_range(options, part)))
        tables, converter = TableResolver(self.catalog, self.config).prepare(data)
        config = self.config
        out = write_task(data, tables, converter, errors=config.errors, pipeline=self.group)
        # announced on another channel than the test's: no channel positions to record
        files = tuple(PendingFile(m, "live", seq, "0", seq) for m in out.files[table])
        result = self.committer.commit(
            TableCommitRequest(table, f"c{seq}", files, {}, {self.topic: {0: end}}, 1)
        )
        assert result.snapshot_id is not None
        return result.snapshot_id

    def roll_back(self, snapshot_id: int) -> Rollback:
        rollback = self.committer.roll_back(self.rolled, snapshot_id)
        assert rollback is not None
        return rollback


@pytest.fixture
def make_scene(
    kafka_broker: EmbeddedKafkaBroker,
    tmp_path: Path,
    produce: Any,
    new_topic: Callable[..., str],
) -> Callable[..., Scene]:
    def make(
        foreign_first: bool = False, dead_letter: bool = False, dynamic: bool = False
    ) -> Scene:
        topic = new_topic(partitions=1)
        return Scene(kafka_broker, tmp_path, produce, topic, foreign_first, dead_letter, dynamic)

    return make


@pytest.fixture
def scene(make_scene: Callable[..., Scene]) -> Scene:
    return make_scene()


@pytest.fixture
def backend(scene: Scene) -> MemoryBackend:
    return MemoryBackend(MemoryServer(), scene.group)


def commit_cycle(
    scene: Scene, backend: MemoryBackend, files: int, plugins: Plugins | None = None
) -> None:
    """A real coordinator reads the channel and runs one cycle (telling ``plugins``)."""
    coordinator = Coordinator(
        scene.group,
        backend.coordinator("c"),
        scene.catalog,
        CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=3600.0),
        coordinator_id="c",
        plugins=plugins,
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


def test_a_replay_without_rows_for_the_table_accepts_the_rollback(
    scene: Scene, backend: MemoryBackend
) -> None:
    """The rolled-back range holds no row of A any more: its records are routed elsewhere now
    (kind a to B) or set aside (kind b is routed nowhere: dead-lettered in a live run, skipped
    by the replay). Nothing is published; the rollback is accepted, and A's live files commit
    instead of waiting for a replay that never comes."""
    scene.roll_back(scene.snapshots[0])
    scene.data["tables"] = [
        {"name": A, "route_field": "kind", "route_values": ["z"]},
        {"name": B, "route_field": "kind", "route_values": ["a", "c"]},
    ]
    scene.data["errors"] = {"policy": "dead_letter", "dead_letter_table": DEAD}
    ensure_dead_letter_table(scene.catalog, scene.config)
    watcher = RollbackWatcher(scene.config, scene.catalog, backend, reader_options(scene))
    assert [r.table for r in watcher.check()] == [A]
    assert scene.committer.rollback(A) is None
    live = WriterClient(backend.writer("w2"), scene.group, "w2")
    live.start()
    try:
        table = scene.catalog.load_table(A)
        row = pa.table({"id": [5000], "name": ["x"], "kind": ["a"]}, table.schema().as_arrow())
        live.publish(0, {A: write_data_files(table, row)}, ())
        commit_cycle(scene, backend, 1)  # the writer answers the cycle
    finally:
        live.close()
    assert_exactly_once(scene.catalog, A, [*routed(A, range(10)), 5000])


def dead_letter_offsets(scene: Scene) -> list[int]:
    rows = scene.catalog.load_table(DEAD).scan(selected_fields=("offset",)).to_arrow()
    return sorted(rows["offset"].to_pylist())


def test_a_rolled_back_dead_letter_table_gets_its_dead_letters_again(
    make_scene: Callable[..., Scene],
) -> None:
    """The dead-letter table is a table the pipeline commits to like any other. Rolled back
    (by any tool), it gets the dead letters of the lost range again, once; before, no driver
    checked it and its new files waited for a replay for good."""
    scene = make_scene(dead_letter=True)
    bad = [i for i in range(30) if i % 3 == 2]  # kind c: routed nowhere
    assert dead_letter_offsets(scene) == bad
    first, _ = scene.dead_letter_snapshots
    assert scene.committer.roll_back(DEAD, first) is not None
    backend = MemoryBackend(MemoryServer(), scene.group)
    watcher = RollbackWatcher(scene.config, scene.catalog, backend, reader_options(scene))
    assert [r.table for r in watcher.check()] == [DEAD]
    commit_cycle(scene, backend, 1)
    assert dead_letter_offsets(scene) == bad
    assert scene.committer.rollback(DEAD) is None


def test_a_rolled_back_dynamic_table_gets_its_rows_again(make_scene: Callable[..., Scene]) -> None:
    """A table of ``[dynamic_tables]`` is listed nowhere; the drivers find it in the catalog
    (the pipeline committed to it) and replay it like a ``[[tables]]`` entry; before, none
    checked it and its new files waited for a replay for good."""
    scene = make_scene(dynamic=True)
    kind_a = [i for i in range(30) if i % 3 == 0]
    assert sorted(table_ids(scene.catalog, DYN)) == kind_a
    scene.roll_back(scene.snapshots[0])
    backend = MemoryBackend(MemoryServer(), scene.group)
    watcher = RollbackWatcher(scene.config, scene.catalog, backend, reader_options(scene))
    assert [r.table for r in watcher.check()] == [DYN]
    commit_cycle(scene, backend, 1)
    assert_exactly_once(scene.catalog, DYN, kind_a)
    assert scene.catalog.load_table("dyn.b").current_snapshot() is None


def test_a_replay_leaves_out_the_records_the_dead_letter_table_holds(
    make_scene: Callable[..., Scene],
) -> None:
    """Kind c went to the dead-letter table (no table took it); then the operator routed kind
    c to A too, and A was rolled back. The replay converted the lost range with today's routes
    and put its kind c records in A as well: each in both tables. What was set aside stays set
    aside: the replay leaves out the offsets the dead-letter table holds for A or for no
    table."""
    scene = make_scene(dead_letter=True)
    bad = [i for i in range(30) if i % 3 == 2]  # kind c
    assert dead_letter_offsets(scene) == bad
    scene.roll_back(scene.snapshots[0])
    scene.data["tables"] = [{"name": A, "route_field": "kind", "route_values": ["a", "b", "c"]}]
    backend = MemoryBackend(MemoryServer(), scene.group)
    watcher = RollbackWatcher(scene.config, scene.catalog, backend, reader_options(scene))
    assert [r.table for r in watcher.check()] == [A]
    commit_cycle(scene, backend, 1)
    assert_exactly_once(scene.catalog, A, routed(A, range(30)))
    assert dead_letter_offsets(scene) == bad
    assert scene.committer.rollback(A) is None


@pytest.mark.parametrize(("policy", "level"), [("dead_letter", "ERROR"), ("skip", "WARNING")])
def test_a_replay_names_the_records_it_leaves_out_because_they_fail_today(
    make_scene: Callable[..., Scene], caplog: pytest.LogCaptureFixture, policy: str, level: str
) -> None:
    """A held kinds a and b (kind c: the dead-letter table, or table B under ``skip``). The
    operator then routed only kind a to A and rolled A back: the replay, with today's routes,
    leaves out the lost range's kind b records, which were A's rows and are now in no table.
    Before, nothing said so. The report names exactly those (7), not the kind c records. Under
    ``skip`` it is a warning: a record skipped the first time would be among them too."""
    scene = make_scene(dead_letter=policy == "dead_letter")
    scene.roll_back(scene.snapshots[0])
    scene.data["tables"][0] = {"name": A, "route_field": "kind", "route_values": ["a"]}
    if policy == "skip":
        scene.data["errors"] = {"policy": "skip"}
    backend = MemoryBackend(MemoryServer(), scene.group)
    watcher = RollbackWatcher(scene.config, scene.catalog, backend, reader_options(scene))
    with caplog.at_level(logging.WARNING, logger="icefloe_spark.replay"):
        assert [r.table for r in watcher.check()] == [A]
    commit_cycle(scene, backend, 1)
    kind_a = [i for i in range(10, 30) if i % 3 == 0]
    assert_exactly_once(scene.catalog, A, [*routed(A, range(10)), *kind_a])
    reports = [r for r in caplog.records if "were not replayed" in r.getMessage()]
    assert [r.levelname for r in reports] == [level]
    message = reports[0].getMessage()
    assert f"rollback of {A}: 7 record(s)" in message
    assert re.findall(r"record \S+\[0\]@(\d+)", message) == ["10", "13", "16"]
    assert f"roll {A} back to snapshot {scene.snapshots[0]} again" in message
    assert ("policy = skip" in message) == (policy == "skip")


def test_a_watcher_check_loads_each_table_once_and_passes_over_a_dropped_one(
    scene: Scene,
    backend: MemoryBackend,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A check runs every ``rollback_check_interval_s`` over every table of the pipeline: it
    loaded each twice (the catalog's ``table_exists`` is a full load in pyiceberg, then the
    rollback check), a sixth of the driver's CPU at 1,000 tables. A table dropped since it
    was listed is passed over without a warning."""
    watcher = RollbackWatcher(scene.config, scene.catalog, backend, reader_options(scene))
    loads = _count_loads(scene.catalog, monkeypatch)
    assert watcher.check() == []
    assert {A, B} <= set(loads)
    assert max(loads.values()) == 1, loads
    scene.catalog.drop_table(B)
    with caplog.at_level(logging.WARNING):
        assert watcher.check() == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def _count_loads(catalog: Catalog, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every ``load_table`` of ``catalog``'s class from now on, per table."""
    loads: Counter[str] = Counter()
    kind = type(catalog)
    original = kind.load_table

    def counted(self: Catalog, identifier: Any) -> Any:
        loads[identifier if isinstance(identifier, str) else ".".join(identifier)] += 1
        return original(self, identifier)

    monkeypatch.setattr(kind, "load_table", counted)
    return loads


def test_a_watcher_beside_the_coordinator_does_not_load_what_the_coordinator_committed(
    scene: Scene, backend: MemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the coordinator runs in the driver, its commits tell the watcher (a plugin of
    ``icefloe_after_table_commit``) the version each made, in which no rollback waits: the
    next check does not load that table again (it did, every table every cycle, most of the
    watcher's CPU at 1,000 tables). A rollback on top of that version is still found."""
    watcher = RollbackWatcher(scene.config, scene.catalog, backend, reader_options(scene))
    plugins = new_plugins(autoload=False)
    plugins.pm.register(watcher)
    scene.roll_back(scene.snapshots[0])
    assert [r.table for r in watcher.check()] == [A]
    commit_cycle(scene, backend, 1, plugins)  # the replay, committed to A
    assert_exactly_once(scene.catalog, A, routed(A, range(30)))
    loads = _count_loads(scene.catalog, monkeypatch)
    assert watcher.check() == []
    assert loads[A] == 0, loads
    scene.roll_back(scene.snapshots[0])  # the operator again, on top of that version
    assert [r.table for r in watcher.check()] == [A]
