"""Per-table commit branches (``tables.branch``): a real SQLite catalog, real Parquet files and
the reference channel. Two tables of one pipeline commit to different branches exactly once;
everything that reads a table's per-branch state (dedupe boundary, resume, status, maintain)
reads that table's branch."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.policy import TablePolicies, TablePolicy
from icefloe.commit.summary import state_property
from icefloe.config import config_from_dict
from icefloe.coordination.coordinator import CoordinatorHooks, CoordinatorSettings
from icefloe.coordination.resume import committed
from icefloe.ops.maintenance import dedupe_snapshots
from icefloe.ops.status import PipelineStatus, render_lines, table_status
from icefloe.testing.fixtures import assert_exactly_once, group_snapshots, table_ids
from icefloe.testing.harness import Pipe, RowSource, SimulatedCrash, crash, lead, wait_pending
from icefloe.testing.memory import MemoryBackend, MemoryServer

AUDITED, PLAIN = "db.orders", "db.events"
POLICIES = TablePolicies(TablePolicy(), {AUDITED: TablePolicy(branch="audit")})


@pytest.fixture
def group_id() -> str:
    return f"pipe-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def backend(memory_server: MemoryServer, group_id: str) -> MemoryBackend:
    return MemoryBackend(memory_server, group_id, 1.0)


@pytest.fixture
def source(sqlite_catalog: SqlCatalog) -> RowSource:
    return RowSource.create(sqlite_catalog, (AUDITED, PLAIN))


@pytest.fixture
def pipe(
    backend: MemoryBackend, sqlite_catalog: SqlCatalog, group_id: str, source: RowSource
) -> Iterator[Pipe]:
    settings = CoordinatorSettings(
        commit_interval_s=3600.0, commit_timeout_s=30.0, policies=POLICIES
    )
    p = Pipe.open(backend, sqlite_catalog, group_id, source, settings)
    yield p
    p.writer.close()


def test_tables_commit_to_their_own_branches_exactly_once(pipe: Pipe) -> None:
    sqlite_catalog, group_id, source = pipe.catalog, pipe.group_id, pipe.source
    pipe.commit_each([0, 1])
    assert_exactly_once(sqlite_catalog, AUDITED, source.expected[AUDITED], branch="audit")
    assert table_ids(sqlite_catalog, AUDITED) == []  # main untouched
    assert sqlite_catalog.load_table(AUDITED).current_snapshot() is None
    assert_exactly_once(sqlite_catalog, PLAIN, source.expected[PLAIN])
    assert "audit" not in sqlite_catalog.load_table(PLAIN).metadata.refs
    audited = sqlite_catalog.load_table(AUDITED).metadata.properties
    assert state_property(group_id, "audit") in audited
    assert state_property(group_id, "main") not in audited
    plain = sqlite_catalog.load_table(PLAIN).metadata.properties
    assert state_property(group_id, "main") in plain


def test_crash_replay_of_a_batch_on_branch_audit_is_not_committed_twice(pipe: Pipe) -> None:
    """The leader commits, then dies before storing the channel position; its successor
    re-reads the batch and must find it in the branch it commits to, not in main."""
    sqlite_catalog, group_id, source, writer = pipe.catalog, pipe.group_id, pipe.source, pipe.writer
    doomed = pipe.coordinator("doomed", CoordinatorHooks(after_iceberg_commits=crash))
    try:
        lead(doomed)
        wait_pending(doomed, source.publish(writer, 0).file_count)
        with pytest.raises(SimulatedCrash):
            doomed.commit_now()
    finally:
        doomed.close()
    assert len(group_snapshots(sqlite_catalog, AUDITED, group_id)) == 1
    # the writer replays batch 0 with new files (a Spark retry), then goes on
    replay = source.batch("w", 0, source.expected_ids_of("w", 0))
    writer.publish(0, replay.files, replay.positions)
    heir = pipe.coordinator("heir")
    try:
        lead(heir)
        wait_pending(heir, source.publish(writer, 1).file_count)
        result = heir.commit_now()
        assert not result.failed
    finally:
        heir.close()
    for name, branch in ((AUDITED, "audit"), (PLAIN, "main")):
        assert_exactly_once(sqlite_catalog, name, source.expected[name], branch=branch)
    assert table_ids(sqlite_catalog, AUDITED) == []


def test_resume_status_drain_and_maintain_read_the_tables_branch(pipe: Pipe) -> None:
    sqlite_catalog, group_id = pipe.catalog, pipe.group_id
    pipe.commit_each([0])
    # resume: the audited table's offsets are on its branch only
    on_branches = committed(sqlite_catalog, group_id, [AUDITED], POLICIES)
    assert on_branches.source_offsets == {"source": {0: 5}}
    assert on_branches.batches == {"w": 0}
    assert committed(sqlite_catalog, group_id, [AUDITED], "main").source_offsets == {}
    # the committer of a pipeline configuration resolves each table's branch
    config = config_from_dict(
        {
            "name": group_id,
            "source": {"topics": ["source"]},
            "tables": [{"name": AUDITED, "branch": "audit"}, {"name": PLAIN}],
        }
    )
    committer = IcebergCommitter.for_pipeline(sqlite_catalog, config)
    assert committer.branch_of(AUDITED) == "audit"
    audited = committer.state(AUDITED)
    assert audited is not None
    head = sqlite_catalog.load_table(AUDITED).snapshot_by_name("audit")
    assert head is not None
    assert audited.snapshot_id == head.snapshot_id
    assert committer.state(PLAIN) is not None
    # status reports the branch's commit
    status = table_status(sqlite_catalog, config, AUDITED, None, time.time() * 1000)
    assert (status.snapshot_id, status.rows, status.branch) == (head.snapshot_id, 5, "audit")
    (line,) = render_lines(PipelineStatus(group_id, "memory", None, None, [status]))[1:]
    assert line.startswith(f"  table {AUDITED} (branch audit): last commit")
    # drain marks a table whose last commit on its branch came through the channel
    channel_id = audited.boundary.channel_id
    assert channel_id is not None
    assert not committer.mark_drained(AUDITED, "another-channel")
    assert committer.mark_drained(AUDITED, channel_id)
    # maintain keeps the chain the dedupe rule walks on the branch
    table = sqlite_catalog.load_table(AUDITED)
    assert audited.snapshot_id in dedupe_snapshots(table.metadata)


def test_config_sets_branches_per_table_and_for_dynamic_tables() -> None:
    config = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "coordination": {"branch": "stage"},
            "tables": [
                {"name": "a.audited", "branch": "audit", "merge_small_files": True},
                {"name": "a.plain"},
            ],
            "dynamic_tables": {"route_field": "kind", "branch": "dyn"},
            "errors": {"policy": "dead_letter", "dead_letter_table": "a.bad"},
        }
    )
    policies = TablePolicies.from_config(config)
    assert policies("a.audited") == TablePolicy(branch="audit", merge_small_files=True)
    assert policies.branch("a.plain") == "stage"
    assert policies.branch("a.bad") == "stage"  # the dead-letter table follows coordination
    assert policies.branch("a.routed_dynamically") == "dyn"
    assert config.dynamic_tables is not None
    assert config.dynamic_tables.table_config("a.x", ["x"]).branch == "dyn"
    settings = CoordinatorSettings.for_pipeline(config)
    assert settings.policies == policies
    assert settings.branch == "stage"
