"""The pure rules of seamless rollback (icefloe.rollback): detection, replay ranges, writer ids.
The committer's side is in test_committer.py, the whole path in tests/test_e2e_rollback.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from icefloe.errors import RollbackNotReplayableError
from icefloe.rollback import (
    ReplayRange,
    Rollback,
    describe,
    detect,
    is_replay_writer,
    keyed_refusal,
    replay_writer_id,
)


@dataclass(frozen=True)
class Snap:
    snapshot_id: int
    source_offsets: dict[str, dict[int, int]] = field(default_factory=dict)


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
