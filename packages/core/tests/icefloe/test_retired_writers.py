"""Summaries that do not grow with every writer ever seen: watermarks of writers that are gone
move to a side file, and the dedupe rule still covers their old batches (real SqlCatalog, real
Parquet files, rows counted with a pyiceberg scan)."""

from __future__ import annotations

import itertools
import json
import time
import uuid

from pyiceberg.catalog.sql import SqlCatalog

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.dedupe import RETIRED_KEY, WATERMARKS_KEY, CommitBoundary, decode_retired
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.commit.retirement import RETIRE_AT
from icefloe.commit.summary import state_property
from icefloe.ops.maintenance import remove_orphan_files
from icefloe.testing.fixtures import (
    assert_exactly_once,
    create_rows_table,
    group_snapshots,
    write_rows,
)

TABLE = "db.events"
WRITERS_PER_CYCLE = 10
CYCLES = 12  # 120 writer ids, each alive for one cycle


class _At:
    def __init__(self, writer_id: str, batch_seq: int, partition: str, offset: int) -> None:
        self.writer_id, self.batch_seq = writer_id, batch_seq
        self.partition, self.offset = partition, offset


def test_retiring_changes_no_answer_of_the_rule() -> None:
    boundary = CommitBoundary({"0": 10}, {"a": 3, "b": 7, "c": 0}, "mem:1")
    retired = boundary.retire({"a", "c"}, "file:///t/metadata/r.json")
    assert dict(retired.watermarks) == {"b": 7}
    assert dict(retired.retired) == {"a": 3, "c": 0}
    assert retired.to_summary()[RETIRED_KEY] == "file:///t/metadata/r.json"
    for writer, seq, offset in itertools.product("abcd", range(-1, 9), (5, 10, 20)):
        at = _At(writer, seq, "0", offset)
        assert retired.covers(at) == boundary.covers(at), (writer, seq, offset)
    # a retired writer that commits again: its new mark is active, the old one still counts
    back = retired.advanced({"0": 30}, [_At("a", 5, "0", 25)])
    assert back.covers(_At("a", 5, "0", 40))
    assert back.covers(_At("a", 2, "0", 40))
    assert not back.covers(_At("a", 6, "0", 40))


def _writer(cycle: int, i: int) -> str:
    return f"query-{cycle:03d}-{i:02d}"


def test_summary_stays_bounded_and_a_retired_writers_replay_is_not_committed_twice(
    sqlite_catalog: SqlCatalog,
) -> None:
    table = create_rows_table(sqlite_catalog, TABLE)
    committer = IcebergCommitter(sqlite_catalog, "pipe")
    uuid_ = str(table.metadata.table_uuid)
    offsets = itertools.count()
    expected: list[int] = []
    first_batches: dict[str, list[int]] = {}
    for cycle in range(CYCLES):
        live = [_writer(cycle, i) for i in range(WRITERS_PER_CYCLE)]
        files = []
        for i, w in enumerate(live):
            ids = [cycle * 1000 + i * 10 + k for k in range(3)]
            [meta] = write_rows(table, ids, w, 0)
            files.append(PendingFile(meta, w, 0, "0", next(offsets), uuid_))
            expected += ids
            first_batches[w] = ids
        result = committer.commit(
            TableCommitRequest(
                TABLE,
                str(uuid.uuid4()),
                tuple(files),
                {"0": next(offsets)},
                {},
                1,
                channel_id="mem:1",
                live_writers=frozenset(live),
            )
        )
        assert result.data_files == WRITERS_PER_CYCLE

    snapshots = group_snapshots(sqlite_catalog, TABLE, "pipe")
    counts = [len(json.loads(s.summary[WATERMARKS_KEY] or "{}")) for s in snapshots]  # type: ignore[index]
    assert max(counts) < WRITERS_PER_CYCLE + RETIRE_AT, counts
    table = sqlite_catalog.load_table(TABLE)
    kept = json.loads(table.metadata.properties[state_property("pipe", "main")])
    assert len(json.loads(kept["summary"][WATERMARKS_KEY])) < WRITERS_PER_CYCLE + RETIRE_AT
    location = kept["summary"][RETIRED_KEY]
    with table.io.new_input(location).open() as stream:
        retired = decode_retired(stream.read())
    assert len(retired) + len(json.loads(kept["summary"][WATERMARKS_KEY])) == 120
    assert all(seq == 0 for seq in retired.values())

    # orphan removal must not take the side file (Iceberg's metadata does not name it)
    future_ms = int(time.time() * 1000) + 60_000
    orphans = remove_orphan_files(table, future_ms, dry_run=True)
    assert location.removeprefix("file://") not in orphans.deleted

    # the oldest writer comes back (a restarted query) and replays its batch 0 with new
    # files at a new channel offset, beyond every recorded position; plus one new batch
    old = _writer(0, 0)
    assert old in retired
    [replayed] = write_rows(table, first_batches[old], old, 0)
    [fresh] = write_rows(table, [999_999], old, 1)
    replay = TableCommitRequest(
        TABLE,
        str(uuid.uuid4()),
        (
            PendingFile(replayed, old, 0, "0", next(offsets), uuid_),
            PendingFile(fresh, old, 1, "0", next(offsets), uuid_),
        ),
        {"0": next(offsets)},
        {},
        1,
        channel_id="mem:1",
        live_writers=frozenset({old}),
    )
    fresh_committer = IcebergCommitter(sqlite_catalog, "pipe")  # a new leader: nothing cached
    result = fresh_committer.commit(replay)
    assert (result.data_files, result.skipped_files) == (1, 1)
    assert_exactly_once(sqlite_catalog, TABLE, [*expected, 999_999])
