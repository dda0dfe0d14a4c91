"""Compaction next to the running pipeline: the coordinator compacts between its cycles.

Real coordinator, committer and writer clients over the reference channel, a real SQLite
catalog and real Parquet files. A coordinator is crashed (a BaseException from a fault hook,
which nothing in the code under test catches) while a compaction's files are written but not
committed, and right after a compaction landed, before the next cycle; an external engine
rewrites the table while cycles run. After each, the table must equal the model (the last
value per key), read by pyiceberg's scan and by an independent reader (fastavro + pyarrow,
position deletes applied by hand).
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.commit.compaction import COMPACTED_FILES_KEY, Thresholds
from icefloe.commit.policy import TablePolicies, TablePolicy
from icefloe.commit.versions import without_retries
from icefloe.coordination.coordinator import (
    Coordinator,
    CoordinatorHooks,
    CoordinatorSettings,
    CycleResult,
)
from icefloe.events import DataFileMeta, SourcePosition
from icefloe.records.datafiles import write_data_files, write_key_files
from icefloe.testing.fixtures import make_sqlite_catalog, sqlite_catalog_properties
from icefloe.testing.harness import (
    DoomedCoordinator,
    Pipe,
    RowSource,
    SimulatedCrash,
    crash,
    kill_doomed_coordinator,
    lead,
    wait_pending,
)
from icefloe.testing.memory import MemoryBackend, MemoryServer, serve_memory_server
from icefloe.testing.readers import independent_rows, live_files

NAME = "db.kv"
SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "v", StringType(), required=False),
    identifier_field_ids=[1],
)
ARROW = pa.schema([pa.field("id", pa.int64(), False), pa.field("v", pa.string())])
EAGER = Thresholds(delete_ratio=0.01, delete_files=2, small_files=2)


class Pipeline:
    """One keyed table, one writer publishing upsert batches as write tasks do, coordinators
    that commit and compact it; ``model`` is what the table must hold."""

    def __init__(
        self, server: MemoryServer, catalog: SqlCatalog, tables: tuple[str, ...] = (NAME,)
    ) -> None:
        self.tables = tables
        self.settings = CoordinatorSettings(
            commit_interval_s=3600.0,
            policies=TablePolicies(
                TablePolicy(), {t: TablePolicy(compaction=EAGER) for t in tables}
            ),
            table_retry_base_s=0.05,
            compaction_budget_s=1e-6 if len(tables) > 1 else 30.0,
        )
        group_id = f"pipe-{uuid.uuid4().hex[:8]}"
        catalog.create_namespace("db")
        for name in tables:
            catalog.create_table(name, schema=SCHEMA)
        backend = MemoryBackend(server, group_id, 1.0)
        # the harness's pipe opens coordinators and the writer; rows are published here
        self.pipe = Pipe.open(backend, catalog, group_id, RowSource(catalog, []), self.settings)
        self.group_id = group_id
        self.catalog = catalog
        self.writer = self.pipe.writer
        self.seq = 0
        self.model: dict[int, str] = {}
        self.coordinators: list[Coordinator] = []

    def coordinator(self, name: str, hooks: CoordinatorHooks | None = None) -> Coordinator:
        c = self.pipe.coordinator(name, hooks)
        self.coordinators.append(c)
        lead(c)
        return c

    def publish(self, upserts: dict[int, str], deletes: tuple[int, ...] = ()) -> int:
        """Publish one batch (the same changes to every table); the files it announces."""
        files: dict[str, list[DataFileMeta]] = {}
        uids: dict[str, str] = {}
        for name in self.tables:
            table = self.catalog.load_table(name)
            metas = []
            if upserts:
                rows = pa.table({"id": list(upserts), "v": list(upserts.values())}, schema=ARROW)
                metas += write_data_files(table, rows)
            keys = pa.table({"id": pa.array([*upserts, *deletes], pa.int64())})
            files[name] = metas + write_key_files(table, keys)
            uids[name] = str(table.metadata.table_uuid)
        self.seq += 1
        position = [SourcePosition("cdc", 0, self.seq, 0)]
        self.writer.publish(self.seq, files, position, uids)
        self.model.update(upserts)
        for k in deletes:
            self.model.pop(k, None)
        return sum(len(m) for m in files.values())

    def random_batch(self, rng: random.Random) -> int:
        picked = rng.sample(range(120), 20)
        return self.publish({k: f"{self.seq}-{k}" for k in picked[5:]}, tuple(picked[:5]))

    def cycle(self, coordinator: Coordinator, files: int) -> CycleResult:
        wait_pending(coordinator, files)
        result = coordinator.commit_now()
        assert result.failed == {}
        return result

    def check(self) -> None:
        table = self.catalog.load_table(NAME)
        want = sorted(self.model.items())
        assert sorted((r["id"], r["v"]) for r in table.scan().to_arrow().to_pylist()) == want
        assert sorted(independent_rows(table, ("id", "v"))) == want

    def compactions(self, name: str = NAME) -> list[Any]:
        table = self.catalog.load_table(name)
        return [
            s
            for s in table.snapshots()
            if s.summary is not None and COMPACTED_FILES_KEY in s.summary.additional_properties
        ]

    def close(self) -> None:
        self.writer.close()
        for c in self.coordinators:
            c.close()


@pytest.fixture
def pipeline(memory_server: MemoryServer, sqlite_catalog: SqlCatalog) -> Iterator[Pipeline]:
    p = Pipeline(memory_server, sqlite_catalog)
    yield p
    p.close()


def test_the_coordinator_compacts_between_cycles(pipeline: Pipeline) -> None:
    rng = random.Random(3)
    c1 = pipeline.coordinator("c1")
    pipeline.cycle(c1, pipeline.publish({k: "v0" for k in range(120)}))
    for _ in range(4):
        pipeline.cycle(c1, pipeline.random_batch(rng))
        pipeline.check()
    assert pipeline.compactions()
    _, deletes = live_files(pipeline.catalog.load_table(NAME))
    assert len(deletes) <= 1  # each round folds the deletes of the cycle before it


@pytest.mark.parametrize("moment", ["during", "after"])
def test_a_coordinator_crashing_during_or_after_a_compaction_loses_nothing(
    pipeline: Pipeline, moment: str
) -> None:
    rng = random.Random(5)
    hooks = (
        CoordinatorHooks(during_compaction=crash)
        if moment == "during"
        else CoordinatorHooks(after_compaction=crash)
    )
    c1 = pipeline.coordinator("c1", hooks)
    pipeline.cycle(c1, pipeline.publish({k: "v0" for k in range(120)}))
    compacted = len(pipeline.compactions())
    files = pipeline.random_batch(rng)
    wait_pending(c1, files)
    with pytest.raises(SimulatedCrash):
        c1.commit_now()  # the cycle commits, its compaction round crashes
    assert len(pipeline.compactions()) == compacted + (moment == "after")
    pipeline.check()

    c2 = pipeline.coordinator("c2")  # takes over once c1's lease expired
    for _ in range(3):
        pipeline.cycle(c2, pipeline.random_batch(rng))
        pipeline.check()
    assert len(pipeline.compactions()) > compacted + (moment == "after")


def test_an_external_rewrite_racing_live_cycles_loses_nothing(pipeline: Pipeline) -> None:
    """Another engine rewrites the whole table (pyiceberg's overwrite with its own scan,
    position deletes applied) again and again while cycles commit upserts and deletes."""
    rng = random.Random(9)
    c1 = pipeline.coordinator("c1")
    pipeline.cycle(c1, pipeline.publish({k: "v0" for k in range(120)}))
    stop = threading.Event()
    rewrites: list[int] = []
    errors: list[BaseException] = []

    def external() -> None:
        from pyiceberg.catalog.sql import SqlCatalog as Other

        other = Other(pipeline.catalog.name, **pipeline.catalog.properties)
        try:
            while not stop.is_set() and len(rewrites) < 6:
                table = without_retries(other.load_table(NAME))
                try:
                    table.overwrite(table.scan().to_arrow())
                    rewrites.append(1)
                except CommitFailedException:
                    continue
                stop.wait(0.05)
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)
        finally:
            other.engine.dispose()

    thread = threading.Thread(target=external)
    thread.start()
    try:
        for _ in range(8):
            pipeline.cycle(c1, pipeline.random_batch(rng))
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert rewrites
    pipeline.check()
    # a last cycle and round on top of the rewritten table
    pipeline.cycle(c1, pipeline.random_batch(rng))
    pipeline.check()


def test_a_rollback_across_a_compaction_snapshot(pipeline: Pipeline) -> None:
    """The compaction snapshot holds no pipeline state: rolling the branch back to the
    pipeline's last cycle below it is no rollback of the pipeline (same rows, nothing to
    replay); rolling back below that cycle is one, detected as for any other snapshot."""
    rng = random.Random(13)
    c1 = pipeline.coordinator("c1")
    pipeline.cycle(c1, pipeline.publish({k: "v0" for k in range(120)}))
    pipeline.cycle(c1, pipeline.random_batch(rng))
    table = pipeline.catalog.load_table(NAME)
    head = table.current_snapshot()
    assert head is not None
    assert head.summary is not None
    assert head.summary.operation.value == "replace"
    below = head.parent_snapshot_id
    assert below is not None
    committer = c1._cycle._committer  # the coordinator's own committer
    assert committer.roll_back(NAME, below) is None
    pipeline.check()
    pipeline.cycle(c1, pipeline.random_batch(rng))
    pipeline.check()

    table = pipeline.catalog.load_table(NAME)
    first = min(table.snapshots(), key=lambda s: s.sequence_number or 0)  # the seed cycle
    rollback = committer.roll_back(NAME, first.snapshot_id)
    assert rollback is not None
    assert rollback.restored_snapshot_id == first.snapshot_id


def test_a_coordinator_process_killed_during_a_compaction_loses_nothing(tmp_path: Path) -> None:
    """A real SIGKILL of a coordinator process while its compaction round's files are
    written (the cycle before it committed); the channel lives in a server process. Slow
    (~10 s, more on a loaded machine) because a real kill needs a spawned child process,
    which imports icefloe and pyiceberg afresh."""
    props = sqlite_catalog_properties(tmp_path / "iceberg")
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    rng = random.Random(17)
    with serve_memory_server() as (server, address):
        pipeline = Pipeline(server, catalog)
        try:
            c1 = pipeline.coordinator("c1")
            pipeline.cycle(c1, pipeline.publish({k: "v0" for k in range(120)}))
            c1.close()
            compacted = len(pipeline.compactions())
            files = pipeline.random_batch(rng)
            spec = DoomedCoordinator(
                address,
                catalog.name,
                props,
                pipeline.group_id,
                1.0,
                files,
                policies=pipeline.settings.policies,
                die_in_compaction=True,
            )
            kill_doomed_coordinator(spec)
            assert len(pipeline.compactions()) == compacted  # the round never landed
            pipeline.check()  # the cycle before it did

            c2 = pipeline.coordinator("c2")
            for _ in range(2):
                pipeline.cycle(c2, pipeline.random_batch(rng))
                pipeline.check()
            assert len(pipeline.compactions()) > compacted
        finally:
            pipeline.close()


def test_a_spent_budget_starves_no_table(
    memory_server: MemoryServer, sqlite_catalog: SqlCatalog
) -> None:
    """With a round budget that one table's round spends, rounds take turns: the second table
    is compacted in the next round, not never."""
    other = "db.kv2"
    pipeline = Pipeline(memory_server, sqlite_catalog, (NAME, other))
    try:
        c1 = pipeline.coordinator("c1")
        pipeline.cycle(c1, pipeline.publish({k: "v0" for k in range(50)}))
        rounds = []
        for n in range(2):
            pipeline.cycle(c1, pipeline.publish({k: f"v{n + 1}" for k in range(10)}))
            rounds.append((len(pipeline.compactions()), len(pipeline.compactions(other))))
        assert rounds == [(0, 1), (1, 1)]  # one table per round, in turns
        pipeline.check()
    finally:
        pipeline.close()
