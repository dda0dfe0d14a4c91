"""The pure rules of seamless rollback (icefloe.commit.rollback): detection, replay ranges, writer
ids; ``icefloe rollback``; a replay refused whole by a real coordinator. The committer's side is
in test_committer.py, the whole path in tests/test_e2e_rollback.py."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import tomli_w
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.io.pyarrow import schema_to_pyarrow
from typer.testing import CliRunner

from icefloe.cli.main import app
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.quarantine import Quarantine
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.commit.rollback import (
    REPLAY_BATCH_SEQ,
    ReplayRange,
    Rollback,
    describe,
    detect,
    in_range,
    is_replay_writer,
    keyed_refusal,
    lost_channel_range,
    replay_writer_id,
    replays,
)
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.errors import ConfigError, RollbackNotReplayableError, RollbackPendingError
from icefloe.ops.drain import DrainError, drain
from icefloe.plugins.manager import new_plugins
from icefloe.testing.fixtures import (
    KEYED_ROWS_SCHEMA,
    assert_exactly_once,
    commit_changes,
    create_rows_table,
    group_snapshots,
    make_sqlite_catalog,
    rows_table,
    sqlite_catalog_properties,
    table_ids,
    write_rows,
)
from icefloe.testing.harness import Batch, RowSource, drive, lead, wait_pending
from icefloe.testing.memory import MemoryBackend, MemoryServer

ROWS = "db.rows"


@dataclass(frozen=True)
class Snap:
    snapshot_id: int
    source_offsets: dict[str, dict[int, int]] = field(default_factory=dict)


def test_the_lost_channel_range_is_what_was_read_between_the_two_snapshots() -> None:
    span = lost_channel_range({"0": 5, "1": 9}, {"0": 12, "1": 9, "2": 4}, same_channel=True)
    assert span == {"0": (5, 12), "2": (0, 4)}
    rollback = dataclasses.replace(
        detect("p", "main", "db.a", Snap(1), Snap(2)) or pytest.fail("no rollback"),
        channel_range=span,
    )
    assert [in_range(rollback, "0", o) for o in (4, 5, 11, 12)] == [False, True, True, False]
    assert not in_range(rollback, "1", 9)
    assert in_range(rollback, "2", 0)
    # offsets of two channels (a swap in between) cannot be compared: nothing is in range
    assert lost_channel_range({"0": 5}, {"0": 12}, same_channel=False) == {}


def test_a_batch_is_replayed_when_its_source_offsets_lie_in_the_replayed_range() -> None:
    """By the source offsets a quarantine entry records, whatever channel the batch came
    through; an entry without them falls back to the channel range."""
    restored = Snap(1, {"t": {0: 10, 1: 5}})
    rollback = detect("p", "main", "db.a", restored, Snap(2, {"t": {0: 20, 1: 5, 2: 7}}))
    assert rollback is not None
    assert rollback.channel_range == {}
    reached = [{"t": {0: o}} for o in (10, 11, 20, 21)]
    assert [replays(rollback, r, "0", 0) for r in reached] == [False, True, True, False]
    assert replays(rollback, {"t": {0: 15, 2: 3}}, "0", 0)  # a partition only the lost records
    assert not replays(rollback, {"t": {0: 15, 1: 5}}, "0", 0)  # partly before the range
    assert not replays(rollback, {"t": {0: 15, 3: 1}}, "0", 0)  # partly past it
    assert not replays(rollback, {"u": {0: 15}}, "0", 0)  # another topic
    spanned = dataclasses.replace(rollback, channel_range={"0": (4, 8)})
    assert [replays(spanned, None, "0", o) for o in (3, 4, 8)] == [False, True, False]
    assert replays(spanned, {}, "0", 4)  # a batch that reports no source position
    assert not replays(spanned, {"t": {0: 10}}, "0", 4)  # the source offsets decide


def test_no_kept_state_or_same_snapshot_is_no_rollback() -> None:
    assert detect("p", "main", "db.a", None, None) is None
    assert detect("p", "main", "db.a", Snap(5), None) is None
    assert detect("p", "main", "db.a", Snap(5), Snap(5)) is None


def test_rollback_spans_restored_to_lost_offsets() -> None:
    rollback = detect("p", "main", "db.a", Snap(5, {"t": {0: 10}}), Snap(9, {"t": {0: 40}}))
    assert rollback is not None
    assert (rollback.restored_snapshot_id, rollback.lost_snapshot_id) == (5, 9)
    assert rollback.ranges() == [ReplayRange("t", 0, 10, 40)]
    assert rollback.writer_id == replay_writer_id("p", "main", "db.a", 5, 9)


def test_replay_writer_id_names_one_rollback() -> None:
    """Same rollback, same id (a retry publishes the same key); any other, another id."""
    base = replay_writer_id("p", "main", "db.a", 5, 9)
    assert is_replay_writer(base)
    others = {
        replay_writer_id("q", "main", "db.a", 5, 9),
        replay_writer_id("p", "dev", "db.a", 5, 9),
        replay_writer_id("p", "main", "db.b", 5, 9),
        replay_writer_id("p", "main", "db.a", None, 9),
        replay_writer_id("p", "main", "db.a", 5, 10),
    }
    assert base not in others
    assert len(others) == 5
    assert not is_replay_writer("p-spark-0123-abc")


def rollback_of(restored: dict[str, dict[int, int]], lost: dict[str, dict[int, int]]) -> Rollback:
    found = detect("p", "main", "db.a", Snap(1, restored) if restored else None, Snap(2, lost))
    assert found is not None
    return found


def test_partitions_without_recorded_start_use_the_beginning() -> None:
    """Before the first commit, or a partition first read after the restored snapshot."""
    rollback = rollback_of({"t": {0: 10}}, {"t": {0: 40, 1: 7}, "u": {0: 3}})
    beginning = {("t", 1): 0, ("u", 0): 2}
    assert rollback.ranges(beginning) == [
        ReplayRange("t", 0, 10, 40),
        ReplayRange("t", 1, 0, 7),
        ReplayRange("u", 0, 2, 3),
    ]


def test_unchanged_partitions_are_not_read() -> None:
    rollback = rollback_of({"t": {0: 10, 1: 5}}, {"t": {0: 12, 1: 5}})
    assert rollback.ranges() == [ReplayRange("t", 0, 10, 12)]


def test_unknown_start_is_refused_with_the_way_out() -> None:
    rollback = rollback_of({}, {"t": {0: 40}})
    with pytest.raises(RollbackNotReplayableError, match=r"t\[0\].*--no-replay"):
        rollback.ranges()


def test_keyed_refusal_names_the_fix() -> None:
    error = keyed_refusal("db.c", "cdc")
    assert isinstance(error, RollbackNotReplayableError)
    assert "cdc mode" in str(error)
    assert "--no-replay" in str(error)


def test_describe_says_what_happens() -> None:
    rollback = rollback_of({"t": {0: 10}}, {"t": {0: 40}})
    text = describe(rollback, "db.a", replay=True)
    assert "rolled back from snapshot 2 to 1" in text
    assert "{'t': {0: 40}}" in text
    assert "nothing to replay" in describe(None, "db.a", replay=True)
    assert "accepted" in describe(None, "db.a", replay=False)


# --- icefloe rollback ---------------------------------------------------------------------


def pipeline_file(
    tmp_path: Path, mode: str = "append", dead_letter: bool = False
) -> tuple[Path, SqlCatalog]:
    """A pipeline file over a real SQLite catalog whose table the pipeline committed to twice
    (ids 1 and 2, source offsets 1 and 2); with ``dead_letter`` that table is the pipeline's
    dead-letter table (``[[tables]]`` lists another)."""
    catalog = make_sqlite_catalog(tmp_path / "iceberg", name="cli")
    table = create_rows_table(catalog, "db.t")
    committer = IcebergCommitter(catalog, "p")
    for seq in range(2):
        metas = write_rows(table, [seq + 1], "w", seq)
        files = tuple(PendingFile(m, "w", seq, "0", seq) for m in metas)
        committer.commit(
            TableCommitRequest("db.t", f"c{seq}", files, {"0": seq + 1}, {"t": {0: seq + 1}}, 1)
        )
    entry: dict[str, Any] = {"name": "db.t", "mode": mode}
    if mode != "append":
        entry["id_columns"] = ["id"]
    data = {
        "name": "p",
        "source": {"topics": ["t"]},
        "tables": [entry],
        "catalog": {
            "name": "cli",
            "properties": {"type": "sql", **sqlite_catalog_properties(tmp_path / "iceberg")},
        },
        "coordination": {"backend": "memory"},
    }
    if dead_letter:
        data["tables"] = [{"name": "db.listed"}]
        data["errors"] = {"policy": "dead_letter", "dead_letter_table": "db.t"}
    path = tmp_path / "pipeline.toml"
    path.write_text(tomli_w.dumps(data))
    return path, catalog


def snapshot_ids(catalog: SqlCatalog) -> list[int]:
    return [s.snapshot_id for s in catalog.load_table("db.t").snapshots()]


def test_cli_rolls_back_and_says_what_the_pipeline_will_replay(tmp_path: Path) -> None:
    path, catalog = pipeline_file(tmp_path)
    first, second = snapshot_ids(catalog)
    result = CliRunner().invoke(app, ["rollback", "-c", str(path), "db.t", str(first)])
    assert result.exit_code == 0, result.output
    assert f"rolled back from snapshot {second} to {first}" in result.stdout
    assert "{'t': {0: 1}} up to {'t': {0: 2}}" in result.stdout
    current = catalog.load_table("db.t").current_snapshot()
    assert current is not None
    assert current.snapshot_id == first
    assert IcebergCommitter(catalog, "p").rollback("db.t") is not None


def test_cli_no_replay_accepts_the_rollback(tmp_path: Path) -> None:
    path, catalog = pipeline_file(tmp_path)
    first, _ = snapshot_ids(catalog)
    args = ["rollback", "-c", str(path), "db.t", str(first), "--no-replay"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "accepted" in result.stdout
    assert IcebergCommitter(catalog, "p").rollback("db.t") is None


def test_cli_rolls_back_the_dead_letter_table_too(tmp_path: Path) -> None:
    """The dead-letter table is committed like the listed tables, so it can be rolled back
    and replayed, or the rollback accepted (``--no-replay``: the way out for a rollback
    another tool made)."""
    path, catalog = pipeline_file(tmp_path, dead_letter=True)
    first, second = snapshot_ids(catalog)
    result = CliRunner().invoke(app, ["rollback", "-c", str(path), "db.t", str(first)])
    assert result.exit_code == 0, result.output
    assert f"rolled back from snapshot {second} to {first}" in result.stdout
    args = ["rollback", "-c", str(path), "db.t", str(first), "--no-replay"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert IcebergCommitter(catalog, "p").rollback("db.t") is None


def test_cli_refuses_to_replay_a_keyed_table_naming_the_fix(tmp_path: Path) -> None:
    path, catalog = pipeline_file(tmp_path, mode="upsert")
    first, second = snapshot_ids(catalog)
    result = CliRunner().invoke(app, ["rollback", "-c", str(path), "db.t", str(first)])
    assert isinstance(result.exception, RollbackNotReplayableError)
    assert "--no-replay" in str(result.exception)
    current = catalog.load_table("db.t").current_snapshot()
    assert current is not None
    assert current.snapshot_id == second  # nothing changed


def test_cli_names_an_unknown_table(tmp_path: Path) -> None:
    path, _ = pipeline_file(tmp_path)
    result = CliRunner().invoke(app, ["rollback", "-c", str(path), "db.other", "1"])
    assert isinstance(result.exception, ConfigError)
    assert result.exception.key == "tables"


def test_status_shows_a_rollback_waiting_for_its_replay(tmp_path: Path) -> None:
    from icefloe.config import load_config
    from icefloe.ops.status import table_status

    path, catalog = pipeline_file(tmp_path)
    first, second = snapshot_ids(catalog)
    config = load_config(path)
    assert table_status(catalog, config, "db.t", None, 0).rollback == ""
    IcebergCommitter(catalog, "p").roll_back("db.t", first)
    shown = table_status(catalog, config, "db.t", None, 0)
    assert f"rolled back from snapshot {second} to {first}" in shown.rollback


# --- a replay that brings no file ---------------------------------------------------------


def simulation_finding(reason: str) -> pytest.MarkDecorator:
    """An open defect the commit-path simulation (test_simulation.py) found: fails until fixed."""
    return pytest.mark.xfail(strict=True, reason=f"found by the commit-path simulation: {reason}")


@dataclass
class Replaying:
    """Writer ``w1`` of pipeline ``pipe`` and its coordinator (failed tables retried at once)
    on a real SQLite catalog, and the replay of a rollback as the driver publishes it."""

    catalog: SqlCatalog
    source: RowSource
    backend: MemoryBackend
    writer: WriterClient
    coordinator: Coordinator

    @classmethod
    def open(cls, tmp_path: Path, max_pending_files: int | None = None) -> Replaying:
        catalog = make_sqlite_catalog(tmp_path / "iceberg")
        backend, writer, coordinator = _run_on(catalog, MemoryServer(), max_pending_files)
        return cls(catalog, RowSource.create(catalog, [ROWS]), backend, writer, coordinator)

    def swap(self) -> None:
        """Stop, ``icefloe drain`` the channel, and go on with the same writer id on a new one
        (a backend swap)."""
        self.close()
        drainer = _run_on(self.catalog, self.backend.server, None, lead_it=False)[2]
        try:
            drain(drainer, IcebergCommitter(self.catalog, "pipe"), [ROWS], 60.0, 0.0)
        finally:
            drainer.close()
        self.backend, self.writer, self.coordinator = _run_on(self.catalog, MemoryServer(), None)

    def replay(self, writer_id: str, ids: dict[str, list[int]]) -> Batch:
        """The rollback's replay batch: ``ids`` written anew, published under ``writer_id``."""
        replayed = self.source.batch(writer_id, REPLAY_BATCH_SEQ, ids=ids)
        replayer = WriterClient(self.backend.writer(writer_id), "pipe", writer_id)
        replayer.start()
        replayer.publish(REPLAY_BATCH_SEQ, replayed.files, ())
        replayer.close()
        return replayed

    def committed(self, seq: int) -> int:
        """Batch ``seq`` of ``w1`` published and committed by a cycle of its own: the snapshot
        that cycle made."""
        wait_pending(self.coordinator, self.source.publish(self.writer, seq).file_count)
        [done] = self.coordinator.commit_now().tables
        assert done.snapshot_id is not None
        return done.snapshot_id

    def two_commits(self) -> tuple[int, Batch]:
        """Batches 0 and 1 of ``w1``, each committed by its own cycle: the first one's
        snapshot (to roll back to) and the second batch (which that rollback loses)."""
        kept = self.committed(0)
        lost = self.source.publish(self.writer, 1)
        wait_pending(self.coordinator, lost.file_count)
        assert not self.coordinator.commit_now().failed
        return kept, lost

    def announce_again(self, batch: Batch) -> None:
        """``batch``'s very files announced again by a writer with a fresh id (its watermark
        covers nothing of them), and a cycle."""
        again = WriterClient(self.backend.writer("w9"), "pipe", "w9")
        again.start()
        again.publish(0, batch.files, ())
        again.close()
        wait_pending(self.coordinator, batch.file_count)
        assert not self.coordinator.commit_now(wait_for_writers=False).failed  # w9 is gone

    def close(self) -> None:
        self.writer.close()
        self.coordinator.close()


def _run_on(
    catalog: SqlCatalog, server: MemoryServer, max_pending_files: int | None, lead_it: bool = True
) -> tuple[MemoryBackend, WriterClient, Coordinator]:
    """Writer ``w1`` of pipeline ``pipe`` and its coordinator (failed tables retried at once)
    on the channel ``server`` holds."""
    backend = MemoryBackend(server, "pipe")
    writer = WriterClient(backend.writer("w1"), "pipe", "w1")
    writer.start()
    settings = CoordinatorSettings(
        3600,
        30,
        table_retry_base_s=0.0,
        table_retry_max_s=0.0,
        max_pending_files=max_pending_files,
    )
    plugins = new_plugins(autoload=False)
    coordinator = Coordinator("pipe", backend.coordinator("c1"), catalog, settings, plugins=plugins)
    if lead_it:
        lead(coordinator)
    return backend, writer, coordinator


def test_a_replay_refused_whole_does_not_hold_the_table_back(tmp_path: Path) -> None:
    """The replay batch came, but screening refused every file of it (the table's partition
    spec changed while it was in flight), so no request ever carries a replay file. Its rows
    are in the quarantine (recoverable with ``add_files``) and the rollback is done: the live
    files commit instead of waiting for good for a replay that came already."""
    pipe = Replaying.open(tmp_path)
    catalog, source, writer, coordinator = pipe.catalog, pipe.source, pipe.writer, pipe.coordinator
    try:
        kept = source.publish(writer, 0)
        wait_pending(coordinator, kept.file_count)
        [first] = coordinator.commit_now().tables
        wait_pending(coordinator, source.publish(writer, 1).file_count)
        assert not coordinator.commit_now().failed
        assert first.snapshot_id is not None
        rollback = IcebergCommitter(catalog, "pipe").roll_back(ROWS, first.snapshot_id)
        assert rollback is not None
        replayed = pipe.replay(rollback.writer_id, source.expected_ids_of("w1", 1))
        with catalog.load_table(ROWS).update_spec() as update:
            update.add_identity("writer")
        live = source.publish(writer, 2)  # written under the new spec
        wait_pending(coordinator, live.file_count + replayed.file_count)
        cycles = [coordinator.commit_now() for _ in range(3)]
    finally:
        pipe.close()
    assert [c.failed for c in cycles] == [{}, {}, {}]
    assert sorted(e.file_path for e in Quarantine(catalog).list("pipe", ROWS)) == sorted(
        f.path for f in replayed.files[ROWS]
    )
    assert_exactly_once(catalog, ROWS, kept.ids[ROWS] + live.ids[ROWS])
    assert IcebergCommitter(catalog, "pipe").rollback(ROWS) is None


def test_a_replay_over_a_quarantined_batch_leaves_each_row_in_one_place(tmp_path: Path) -> None:
    """Batch 1 was quarantined (written under a partition spec that changed before its
    commit), batch 2 committed; a rollback to batch 0's snapshot loses the range of 1 and 2,
    and the replay (the driver reads that range again and writes it under today's spec) holds
    batch 1's records too. Each record must end in the table or in the quarantine, once."""
    pipe = Replaying.open(tmp_path)
    catalog, source, writer, coordinator = pipe.catalog, pipe.source, pipe.writer, pipe.coordinator
    try:
        wait_pending(coordinator, source.publish(writer, 0).file_count)
        [first] = coordinator.commit_now().tables
        refused = source.publish(writer, 1)
        wait_pending(coordinator, refused.file_count)
        with catalog.load_table(ROWS).update_spec() as update:
            update.add_identity("writer")
        assert dict(coordinator.commit_now().quarantined) == {ROWS: refused.file_count}
        wait_pending(coordinator, source.publish(writer, 2).file_count)
        assert not coordinator.commit_now().failed
        assert first.snapshot_id is not None
        rollback = IcebergCommitter(catalog, "pipe").roll_back(ROWS, first.snapshot_id)
        assert rollback is not None
        lost = source.expected_ids_of("w1", 1)[ROWS] + source.expected_ids_of("w1", 2)[ROWS]
        replayed = pipe.replay(rollback.writer_id, {ROWS: lost})
        wait_pending(coordinator, replayed.file_count)
        assert not coordinator.commit_now().failed
    finally:
        pipe.close()
    table = catalog.load_table(ROWS)
    in_table = [int(i) for i in table.scan().to_arrow()["id"].to_pylist()]
    quarantined = [
        int(i)
        for e in Quarantine(catalog).list("pipe", ROWS)
        for i in pq.read_table(e.file_path.removeprefix("file://"))["id"].to_pylist()
    ]
    assert sorted(in_table + quarantined) == sorted(source.expected[ROWS])


def test_a_replay_after_a_swap_retires_the_quarantined_batch_by_its_source_offsets(
    tmp_path: Path,
) -> None:
    """Found by the commit-path simulation: batch 0 committed, a drain and a backend swap,
    batch 1 quarantined and batch 2 committed through the new channel, a rollback to batch 0's
    snapshot and its replay (batches 1 and 2 read again). The restored and the lost snapshot
    record channel positions of two channels, which cannot be compared: the entry must be
    retired by the source offsets batch 1 reached, or its records are in the table and in
    the quarantine."""
    pipe = Replaying.open(tmp_path)
    catalog, source = pipe.catalog, pipe.source
    try:
        wait_pending(pipe.coordinator, source.publish(pipe.writer, 0).file_count)
        [first] = pipe.coordinator.commit_now().tables
        pipe.swap()
        refused = source.publish(pipe.writer, 1)
        wait_pending(pipe.coordinator, refused.file_count)
        with catalog.load_table(ROWS).update_spec() as update:
            update.add_identity("writer")
        assert dict(pipe.coordinator.commit_now().quarantined) == {ROWS: refused.file_count}
        wait_pending(pipe.coordinator, source.publish(pipe.writer, 2).file_count)
        assert not pipe.coordinator.commit_now().failed
        assert first.snapshot_id is not None
        rollback = IcebergCommitter(catalog, "pipe").roll_back(ROWS, first.snapshot_id)
        assert rollback is not None
        assert rollback.channel_range == {}  # two channels: no channel range
        lost = source.expected_ids_of("w1", 1)[ROWS] + source.expected_ids_of("w1", 2)[ROWS]
        replayed = pipe.replay(rollback.writer_id, {ROWS: lost})
        wait_pending(pipe.coordinator, replayed.file_count)
        assert not pipe.coordinator.commit_now().failed
    finally:
        pipe.close()
    assert Quarantine(catalog).list("pipe", ROWS) == []
    assert_exactly_once(catalog, ROWS, source.expected[ROWS])


@pytest.mark.parametrize("rewritten", [False, True], ids=["appended", "rewritten"])
def test_another_engine_expiring_a_snapshot_between_is_no_rollback(
    tmp_path: Path, rewritten: bool
) -> None:
    """The pipeline's snapshot is kept (a tag names it), another engine's snapshot after it
    was expired (explicitly, or by age with the tag protecting the older one), a newer one of
    that engine is the head. Nothing was rolled back: the next batch commits. Also when that
    engine rewrote the table before (``rewritten``): the head then references none of the
    files the kept snapshot added, but a snapshot in its history removed them, which only a
    descendant's history holds."""
    pipe = Replaying.open(tmp_path)
    catalog, source, writer, coordinator = pipe.catalog, pipe.source, pipe.writer, pipe.coordinator
    try:
        mine = pipe.committed(0)
        for i in (-1, -2):  # another engine appends twice
            catalog.load_table(ROWS).append(rows_table([i], "x", 0))
        table = catalog.load_table(ROWS)
        between = [s.snapshot_id for s in table.snapshots()][1]
        with table.manage_snapshots() as refs:
            refs.create_tag(mine, "kept")
        if rewritten:
            table = catalog.load_table(ROWS)
            table.overwrite(table.scan().to_arrow())
        catalog.load_table(ROWS).maintenance.expire_snapshots().by_id(between).commit()
        wait_pending(coordinator, source.publish(writer, 1).file_count)
        failed = coordinator.commit_now().failed
    finally:
        pipe.close()
    assert dict(failed) == {}
    assert_exactly_once(catalog, ROWS, [*source.expected[ROWS], -1, -2])


def test_another_engine_rewriting_then_expiring_the_pipelines_snapshot_is_no_rollback(
    tmp_path: Path,
) -> None:
    """Another engine rewrites the table (pyiceberg's overwrite: a ``delete`` of every file,
    then an ``append``) and expires the pipeline's only snapshot; pyiceberg's expiry clears
    the ``delete`` snapshot's parent id, and that snapshot holds no file at all, so it looked
    like a root: the history seemed whole, the pipeline's kept snapshot absent from it, and
    the committer took it for a rollback to nothing (its replay then committed the rows a
    second time; found by the 40-step simulation search, seed 61200). A snapshot that removed
    files had a parent: nothing was rolled back, the next batch commits."""
    pipe = Replaying.open(tmp_path)
    catalog, source, writer, coordinator = pipe.catalog, pipe.source, pipe.writer, pipe.coordinator
    try:
        mine = pipe.committed(0)
        table = catalog.load_table(ROWS)
        table.overwrite(table.scan().to_arrow())
        catalog.load_table(ROWS).maintenance.expire_snapshots().by_id(mine).commit()
        assert IcebergCommitter(catalog, "pipe").rollback(ROWS) is None
        wait_pending(coordinator, source.publish(writer, 1).file_count)
        failed = coordinator.commit_now().failed
    finally:
        pipe.close()
    assert dict(failed) == {}
    assert_exactly_once(catalog, ROWS, source.expected[ROWS])


def test_a_replay_commits_after_another_engine_expired_the_restored_snapshot(
    tmp_path: Path,
) -> None:
    """A rollback to another engine's snapshot above the pipeline's first: its replay is
    published, then that engine expires the pipeline's snapshot the rollback restored (no ref
    names it). The branch's history now stops above it, so the committer refused the pending
    rollback as not replayable and the published replay could never commit (found by the
    commit-path simulation, seed 24704). The table's earlier metadata files still link the
    head to the restored snapshot, as when the replay was published: the same rollback is
    found, and its replay commits."""
    pipe = Replaying.open(tmp_path)
    catalog, source, coordinator = pipe.catalog, pipe.source, pipe.coordinator
    try:
        restored = pipe.committed(0)
        catalog.load_table(ROWS).append(rows_table([-1], "x", 0))
        other = catalog.load_table(ROWS).metadata.current_snapshot_id
        assert other is not None
        lost = pipe.committed(1)
        rollback = IcebergCommitter(catalog, "pipe").roll_back(ROWS, other)
        assert rollback is not None
        assert (rollback.restored_snapshot_id, rollback.lost_snapshot_id) == (restored, lost)
        replayed = pipe.replay(rollback.writer_id, source.expected_ids_of("w1", 1))
        catalog.load_table(ROWS).maintenance.expire_snapshots().by_id(restored).commit()
        assert IcebergCommitter(catalog, "pipe").rollback(ROWS) == rollback
        wait_pending(coordinator, replayed.file_count)
        failed = coordinator.commit_now().failed
    finally:
        pipe.close()
    assert dict(failed) == {}
    assert_exactly_once(catalog, ROWS, [*source.expected[ROWS], -1])
    assert IcebergCommitter(catalog, "pipe").rollback(ROWS) is None


def test_a_commit_under_the_memory_bound_records_the_offsets_of_its_batches(
    tmp_path: Path,
) -> None:
    """One pending file fills the bound: the batch's DataWritten is read, its DataComplete
    (the source positions the batch reached) is held back until a cycle commits. The snapshot
    must still record offsets covering the batch: a rollback to before it replays from them."""
    pipe = Replaying.open(tmp_path, max_pending_files=1)
    pipe.catalog.load_table(ROWS).append(rows_table([-1], "x", 0))  # to roll back to
    try:
        batch = pipe.source.publish(pipe.writer, 0)
        table = pipe.catalog.load_table  # the bound makes the cycle due at once
        drive(pipe.coordinator, lambda: len(table(ROWS).snapshots()) == 2, "the commit")
    finally:
        pipe.close()
    committer = IcebergCommitter(pipe.catalog, "pipe")
    rollback = committer.roll_back(ROWS, pipe.catalog.load_table(ROWS).snapshots()[0].snapshot_id)
    [position] = batch.positions
    beginning = {(position.topic, position.partition): 0}
    assert rollback is not None
    assert rollback.ranges(beginning) == [
        ReplayRange(position.topic, position.partition, 0, position.offset)
    ]


def _drain(pipe: Replaying) -> None:
    """``icefloe drain`` of the stopped pipeline's table under a bound of 2 pending files."""
    drainer = _run_on(pipe.catalog, pipe.backend.server, 2, lead_it=False)[2]
    try:
        drain(drainer, IcebergCommitter(pipe.catalog, "pipe"), [ROWS], 60.0, 0.0)
    finally:
        drainer.close()


def test_under_the_memory_bound_files_waiting_for_a_replay_do_not_keep_it_unread(
    tmp_path: Path,
) -> None:
    """Found by the commit-path simulation (seed 62001): live files of a rolled-back table
    fill the bound before its replay batch is read. They wait for the replay, and reading
    waited for them to commit: the table never committed again (I4). Like those of a table
    backing off, they count against the hard cap only, so the replay behind them is read."""
    pipe = Replaying.open(tmp_path, max_pending_files=2)
    catalog, source, coordinator = pipe.catalog, pipe.source, pipe.coordinator
    try:
        first, lost = pipe.two_commits()
        rollback = IcebergCommitter(catalog, "pipe").roll_back(ROWS, first)
        assert rollback is not None
        live = [source.publish(pipe.writer, seq) for seq in (2, 3)]
        wait_pending(coordinator, sum(b.file_count for b in live))
        replayed = pipe.replay(rollback.writer_id, lost.ids)
        replay_done = IcebergCommitter(catalog, "pipe").rollback
        drive(coordinator, lambda: replay_done(ROWS) is None, "the replay's commit", 10)
    finally:
        pipe.close()
    assert replayed.file_count
    assert_exactly_once(catalog, ROWS, source.expected[ROWS])


def test_files_waiting_beside_an_older_rollbacks_replay_do_not_keep_the_new_one_unread(
    tmp_path: Path,
) -> None:
    """Found by the commit-path simulation (``--schedules 100 --seed 25607 --steps 40``): a
    table rolled back, its replay published, and the table rolled back again, further, before
    that replay was committed. Under a bound of 2 pending files the older replay's file and
    live files filled the bound; a replay writer's file among them made them count as not
    waiting for a replay, so reading stopped before the newer replay, the one they wait for,
    and the table never committed again (I4). They wait for the pending rollback's own replay
    writer now, and count against no bound until it is read."""
    pipe = Replaying.open(tmp_path, max_pending_files=2)
    catalog, source, coordinator = pipe.catalog, pipe.source, pipe.coordinator
    committer = IcebergCommitter(catalog, "pipe")
    try:
        s0 = pipe.committed(0)
        s1 = pipe.committed(1)
        pipe.committed(2)
        older = committer.roll_back(ROWS, s1)  # loses batch 2
        assert older is not None
        pipe.replay(older.writer_id, source.expected_ids_of("w1", 2))
        newer = committer.roll_back(ROWS, s0)  # loses batch 1 too, the older replay unread
        assert newer is not None
        assert newer.writer_id != older.writer_id
        live = [source.publish(pipe.writer, seq) for seq in (3, 4)]
        assert sum(b.file_count for b in live) >= 2  # with the older replay: past the bound
        lost = {ROWS: [i for seq in (1, 2) for i in source.expected_ids_of("w1", seq)[ROWS]]}
        pipe.replay(newer.writer_id, lost)
        pending = IcebergCommitter(catalog, "pipe").rollback
        drive(coordinator, lambda: pending(ROWS) is None, "the newer replay's commit", 20)
        drive(coordinator, lambda: not coordinator.pending_files(), "the live files' commit", 20)
    finally:
        pipe.close()
    assert_exactly_once(catalog, ROWS, source.expected[ROWS])


def test_a_drain_under_the_memory_bound_reads_on_to_the_replay_it_commits_with(
    tmp_path: Path,
) -> None:
    """Found by the commit-path simulation (seed 64000): a rollback, its replay published
    behind two live batches of the table, the pipeline stopped, ``icefloe drain`` under a
    bound of 2 pending files. The live files fill the bound, so a cycle runs before the
    replay is read; the table fails with RollbackPendingError, and the drain gave up on that
    (DrainError) although the replay it waits for lies further in the channel. It reads on
    now, and fails only when the channel, read to its end, holds no replay."""
    pipe = Replaying.open(tmp_path, max_pending_files=2)
    catalog, source = pipe.catalog, pipe.source
    try:
        first, lost = pipe.two_commits()
        rollback = IcebergCommitter(catalog, "pipe").roll_back(ROWS, first)
        assert rollback is not None
        live = [source.publish(pipe.writer, seq) for seq in (2, 3)]
        assert sum(b.file_count for b in live) >= 2  # they fill the bound
        pipe.replay(rollback.writer_id, lost.ids)
    finally:
        pipe.close()
    _drain(pipe)
    assert IcebergCommitter(catalog, "pipe").rollback(ROWS) is None
    assert_exactly_once(catalog, ROWS, source.expected[ROWS])


@pytest.mark.parametrize("drained", [False, True], ids=["running", "drained"])
def test_files_waiting_for_a_replay_beyond_the_hard_cap_do_not_keep_it_unread(
    tmp_path: Path, drained: bool
) -> None:
    """Found by the commit-path simulation (seed 24732 of 40 rules, a drain under a bound of
    2 after two rollbacks): files of a rolled-back table counted against the hard cap (4 times
    the bound), so once more of them than that came before the replay batch, reading stopped
    for good and the replay that would commit them was never read (I4; the drain spun until
    its timeout). They commit only with that batch: they count against no bound now."""
    pipe = Replaying.open(tmp_path, max_pending_files=2)
    catalog, source = pipe.catalog, pipe.source
    try:
        first, lost = pipe.two_commits()
        rollback = IcebergCommitter(catalog, "pipe").roll_back(ROWS, first)
        assert rollback is not None
        live = [source.publish(pipe.writer, seq) for seq in range(2, 12)]
        assert sum(b.file_count for b in live) > 4 * 2  # beyond the hard cap
        pipe.replay(rollback.writer_id, lost.ids)
        if not drained:
            replay_done = IcebergCommitter(catalog, "pipe").rollback
            drive(pipe.coordinator, lambda: replay_done(ROWS) is None, "the replay's commit", 20)
    finally:
        pipe.close()
    if drained:
        _drain(pipe)
    assert IcebergCommitter(catalog, "pipe").rollback(ROWS) is None
    assert_exactly_once(catalog, ROWS, source.expected[ROWS])


def test_a_drain_fails_when_the_channel_holds_no_replay_of_a_rolled_back_table(
    tmp_path: Path,
) -> None:
    """The other side of the rule above: without the replay in the channel the drain cannot
    commit the table's files, and says so (the operator starts the pipeline again first)."""
    pipe = Replaying.open(tmp_path, max_pending_files=2)
    catalog = pipe.catalog
    try:
        first, _ = pipe.two_commits()
        assert IcebergCommitter(catalog, "pipe").roll_back(ROWS, first) is not None
        for seq in (2, 3):
            pipe.source.publish(pipe.writer, seq)
    finally:
        pipe.close()
    with pytest.raises(DrainError, match="RollbackPendingError"):
        _drain(pipe)


def test_rows_a_rollback_removed_stay_out_when_their_files_are_announced_again(
    tmp_path: Path,
) -> None:
    """``--no-replay`` keeps the rolled-back rows out; the very files of that batch announced
    again by a writer with a fresh id (watermarks do not cover it) must not bring them back."""
    pipe = Replaying.open(tmp_path)
    try:
        kept, removed = pipe.two_commits()
        IcebergCommitter(pipe.catalog, "pipe").roll_back(ROWS, kept, replay=False)
        pipe.announce_again(removed)
    finally:
        pipe.close()
    assert_exactly_once(pipe.catalog, ROWS, pipe.source.expected_ids_of("w1", 0)[ROWS])


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
def test_files_another_engine_removed_above_a_rollback_stay_out_when_announced_again(
    tmp_path: Path, replay: bool
) -> None:
    """A batch committed, another engine deletes its rows (its file leaves the branch), a
    later batch committed, then a rollback below the first batch. The rollback takes the
    delete out of the branch's history, and the file is live neither at the head nor in the
    pipeline's lost snapshot: announced again under a fresh writer id, it must still be held,
    or its rows come back (beside the replay's copy of them)."""
    pipe = Replaying.open(tmp_path)
    catalog, source, writer, coordinator = pipe.catalog, pipe.source, pipe.writer, pipe.coordinator
    try:
        kept, deleted = pipe.two_commits()
        catalog.load_table(ROWS).delete("batch_seq == 1")
        wait_pending(coordinator, source.publish(writer, 2).file_count)
        assert not coordinator.commit_now().failed
        IcebergCommitter(catalog, "pipe").roll_back(ROWS, kept, replay=replay)
        if replay:
            rollback = IcebergCommitter(catalog, "pipe").rollback(ROWS)
            assert rollback is not None
            lost = {ROWS: [i for n in (1, 2) for i in source.expected_ids_of("w1", n)[ROWS]]}
            wait_pending(coordinator, pipe.replay(rollback.writer_id, lost).file_count)
            assert not coordinator.commit_now().failed
        pipe.announce_again(deleted)
    finally:
        pipe.close()
    # the replay reads the source again: the rows the other engine deleted come back once
    expected = source.expected[ROWS] if replay else source.expected_ids_of("w1", 0)[ROWS]
    assert_exactly_once(catalog, ROWS, expected)


@pytest.mark.parametrize("by", ["icefloe rollback", "another tool"])
def test_replayed_rows_are_not_joined_by_their_old_files_announced_again(
    tmp_path: Path, by: str
) -> None:
    """After a replayed rollback the range's rows are in the table once, in the replay's new
    files; the old files, announced again under a fresh writer id, must not add them twice,
    whether ``icefloe rollback`` or another tool moved the branch."""
    pipe = Replaying.open(tmp_path)
    catalog, source, coordinator = pipe.catalog, pipe.source, pipe.coordinator
    try:
        kept, lost = pipe.two_commits()
        if by == "another tool":
            with catalog.load_table(ROWS).manage_snapshots() as refs:
                refs.create_branch(kept, "main")
        else:
            IcebergCommitter(catalog, "pipe").roll_back(ROWS, kept)
        rollback = IcebergCommitter(catalog, "pipe").rollback(ROWS)
        assert rollback is not None
        replayed = pipe.replay(rollback.writer_id, source.expected_ids_of("w1", 1))
        wait_pending(coordinator, replayed.file_count)
        assert not coordinator.commit_now().failed
        pipe.announce_again(lost)
    finally:
        pipe.close()
    assert_exactly_once(catalog, ROWS, source.expected[ROWS])


KEYED = "db.keyed"


def keyed_table(tmp_path: Path) -> SqlCatalog:
    """A catalog with the upsert table :data:`KEYED` (no snapshot yet)."""
    catalog = make_sqlite_catalog(tmp_path / "iceberg")
    catalog.create_namespace("db")
    catalog.create_table(KEYED, schema=KEYED_ROWS_SCHEMA)
    return catalog


def foreign_append(catalog: SqlCatalog, ids: list[int]) -> int:
    """Another engine appends rows of its own; returns its snapshot id."""
    table = catalog.load_table(KEYED)
    table.append(rows_table(ids, "x", 0).cast(schema_to_pyarrow(table.schema())))
    head = catalog.load_table(KEYED).current_snapshot()
    assert head is not None
    return head.snapshot_id


def delete_only(catalog: SqlCatalog, key: int, batch_seq: int) -> int:
    """The pipeline commits a batch that only deletes ``key``: a position delete file when a
    row holds it, no file at all when none does. Returns its snapshot id."""
    commit_changes(catalog, "pipe", KEYED, deletes=[key], batch_seq=batch_seq)
    [*_, ours] = group_snapshots(catalog, KEYED, "pipe")
    return ours.snapshot_id


def expire(catalog: SqlCatalog, snapshot_id: int) -> None:
    catalog.load_table(KEYED).maintenance.expire_snapshots().by_id(snapshot_id).commit()


@pytest.mark.parametrize(
    "gap",
    ["its empty snapshot expired", "the one after its empty one", "the one after its deletes"],
)
def test_another_engine_expiring_around_a_delete_only_keyed_snapshot_is_no_rollback(
    tmp_path: Path, gap: str
) -> None:
    """The pipeline's newest snapshot only deletes (nothing at all where no row holds the key,
    as the simulation found: seed 50030; else a position delete file), another engine appends
    twice and expires the pipeline's snapshot, or the one between it and the head. Nothing was
    rolled back: the next batch commits. Before: the first took the missing snapshot for a
    rollback to nothing (RollbackPendingError: a keyed table's rollback is never replayed, so
    the table waited for good), the others refused with RollbackNotReplayableError (the check
    for a gap looked for a data file the kept snapshot added, and it added none)."""
    catalog = keyed_table(tmp_path)
    try:
        if gap == "the one after its deletes":
            commit_changes(catalog, "pipe", KEYED, upserts=[1, 2], batch_seq=0)
            ours = delete_only(catalog, 1, 1)  # a position delete file
            kept = [2, 100, 101]
        else:
            ours = delete_only(catalog, 7, 0)  # no row holds key 7: an empty snapshot
            kept = [100, 101]
        between = foreign_append(catalog, [100])
        foreign_append(catalog, [101])
        expire(catalog, ours if gap == "its empty snapshot expired" else between)
        assert IcebergCommitter(catalog, "pipe").rollback(KEYED) is None
        commit_changes(catalog, "pipe", KEYED, upserts=[5], deletes=[101], batch_seq=2)
        assert table_ids(catalog, KEYED) == sorted([*kept[:-1], 5])
    finally:
        catalog.engine.dispose()


@pytest.mark.parametrize("key", [1, 7], ids=["position delete", "no row held the key"])
def test_a_rollback_below_a_delete_only_keyed_snapshot_is_still_one(
    tmp_path: Path, key: int
) -> None:
    """The converse: another tool rolls the branch back below the pipeline's only snapshot (a
    delete-only one), another engine appends, and that snapshot is expired. The branch's line
    reaches a snapshot older than it without passing it: still a rollback (to nothing), never
    taken for an expiry with the pipeline's deletes silently undone."""
    catalog = keyed_table(tmp_path)
    try:
        restored = foreign_append(catalog, [1, 2])
        ours = delete_only(catalog, key, 0)
        with catalog.load_table(KEYED).manage_snapshots() as refs:
            refs.create_branch(restored, "main")
        foreign_append(catalog, [100])
        expire(catalog, ours)
        rollback = IcebergCommitter(catalog, "pipe").rollback(KEYED)
    finally:
        catalog.engine.dispose()
    assert rollback is not None
    assert (rollback.restored_snapshot_id, rollback.lost_snapshot_id) == (None, ours)


def test_a_rollback_pending_error_keeps_its_replay_writer_across_processes() -> None:
    """Committer processes and Spark tasks send a table's error back pickled: the replay
    writer the files wait for must survive, or the memory bound counts them again."""
    sent = RollbackPendingError("its files wait", replay_writer="icefloe-replay-pipe-1")
    got = pickle.loads(pickle.dumps(sent))
    assert (type(got), str(got), got.replay_writer) == (
        RollbackPendingError,
        "its files wait",
        "icefloe-replay-pipe-1",
    )
