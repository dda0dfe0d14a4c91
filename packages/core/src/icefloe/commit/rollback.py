"""Seamless rollback: what a pipeline does when one of its tables is rolled back.

A table rolled back to an earlier snapshot (``icefloe rollback``, or any other tool moving the
branch) no longer holds rows the pipeline committed, while the source has long moved on. The
pipeline notices it from the table alone: every icefloe commit also writes its summary to the
table property ``icefloe.state.<group>.<branch>`` (for snapshot expiry, invariant 8), and a
rollback moves the branch but leaves that property alone. So when the snapshot the property
names is no longer in the branch's history, the table was rolled back from it
(:func:`detect`), and the gap is exactly the source range between the offsets the restored
snapshot records and those the property records (:meth:`Rollback.ranges`).

The Spark runner then *replays* that range for this table only, as one writer batch under a
writer id derived from the rollback (:func:`replay_writer_id`), so a rollback noticed twice or
a replay retried after a crash publishes the same key again. Until that batch arrives, the
committer holds the table's other files back (:class:`~icefloe.errors.RollbackPendingError`),
and it dedupes against the pre-rollback boundary, so the replay and the live stream meet
without a gap or an overlap. Details and limits: docs/operations.md (Rollback).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from icefloe.errors import RollbackNotReplayableError

REPLAY_PREFIX = "icefloe-replay-"
"""Writer ids of replay batches start with this (never use it for a writer id of your own)."""
REPLAY_BATCH_SEQ = 0
"""Each replay writer id publishes exactly one batch, with this number."""

SourceOffsets = Mapping[str, Mapping[int, int]]  # topic -> partition -> next offset


class Recorded(Protocol):
    """What a snapshot of the pipeline records (``icefloe.commit.summary.RecordedCommit`` is
    one)."""

    @property
    def snapshot_id(self) -> int: ...

    @property
    def source_offsets(self) -> SourceOffsets: ...


@dataclass(frozen=True)
class ReplayRange:
    """Records [start, end) of one source partition to read again."""

    topic: str
    partition: int
    start: int
    end: int


@dataclass(frozen=True)
class Rollback:
    """A table rolled back below what its pipeline committed, waiting for its replay."""

    table: str
    restored_snapshot_id: int | None
    """The pipeline's newest snapshot left in the branch history (None: none is left)."""
    lost_snapshot_id: int
    """The pipeline's newest commit before the rollback (no longer in the branch history)."""
    from_offsets: SourceOffsets
    to_offsets: SourceOffsets
    writer_id: str
    """The replay batch's writer id: the same for the same rollback, wherever it is noticed."""
    channel_range: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """``{channel partition: (start, end)}``: the DataWritten offsets the pipeline read between
    the restored and the lost snapshot (empty when they came through different channels).
    Files quarantined from that range hold records of the replayed source range: the replay
    writes them again, so their quarantine entries are retired with it (:func:`in_range`; only
    for entries that do not record their batch's source offsets, see :func:`replays`)."""

    def ranges(self, beginning: Mapping[tuple[str, int], int] | None = None) -> list[ReplayRange]:
        """The source ranges to read again: per partition from the restored offsets (or, for a
        partition the restored snapshot does not record, ``beginning``: where the pipeline
        began reading it) up to the lost ones. Raises RollbackNotReplayableError when a start
        is not known."""
        out: list[ReplayRange] = []
        for topic, parts in sorted(self.to_offsets.items()):
            for partition, end in sorted(parts.items()):
                start = self.from_offsets.get(topic, {}).get(partition)
                if start is None:
                    start = (beginning or {}).get((topic, partition))
                if start is None:
                    raise RollbackNotReplayableError(
                        f"table '{self.table}' was rolled back to a snapshot that records no "
                        f"offset of {topic}[{partition}], and source.starting_offsets does not "
                        'say where the pipeline began reading it (only "earliest" or explicit '
                        "offsets do). Fix: roll back to a snapshot the pipeline made after it "
                        "began reading that partition, or accept the rollback without a replay: "
                        f"icefloe rollback --config <pipeline.toml> {self.table} "
                        "<snapshot id> --no-replay"
                    )
                if end > start:
                    out.append(ReplayRange(topic, partition, start, end))
        return out


def replays(rollback: Rollback, source: SourceOffsets | None, partition: str, offset: int) -> bool:
    """Whether the replay of ``rollback`` writes again the records of a batch that reached
    ``source`` (its DataComplete's source offsets) and was announced at ``partition``/``offset``
    of the channel: by the source offsets when known (:func:`within`), else by the channel
    (:func:`in_range`, which cannot tell after a backend swap)."""
    if source:
        return within(rollback, source)
    return in_range(rollback, partition, offset)


def within(rollback: Rollback, source: SourceOffsets) -> bool:
    """Whether a batch that reached ``source`` lies inside the replayed source range: in every
    source partition it read, past the restored snapshot's offset (a partition the restored
    snapshot does not record is replayed from where the pipeline began) and not past the lost
    snapshot's. Its start is not recorded, and needs not be: a writer's batches read each
    partition in order, so a batch that ends past the restored offset began at it or later
    (the restored snapshot records the end of every batch read before it)."""
    for topic, parts in source.items():
        for partition, end in parts.items():
            start = rollback.from_offsets.get(topic, {}).get(partition)
            stop = rollback.to_offsets.get(topic, {}).get(partition)
            if stop is None or end > stop or (start is not None and end <= start):
                return False
    return True


def in_range(rollback: Rollback, partition: str, offset: int) -> bool:
    """Whether a file announced at ``partition``/``offset`` was read in the rolled-back range
    (its records are in the source range the replay reads again)."""
    start, end = rollback.channel_range.get(partition, (0, 0))
    return start <= offset < end


def lost_channel_range(
    restored: Mapping[str, int], lost: Mapping[str, int], same_channel: bool
) -> dict[str, tuple[int, int]]:
    """:attr:`Rollback.channel_range` from the channel positions the restored and the lost
    snapshot record."""
    if not same_channel:
        return {}  # offsets of two channels cannot be compared: retire nothing
    spans = {p: (restored.get(p, 0), end) for p, end in lost.items()}
    return {p: span for p, span in sorted(spans.items()) if span[0] < span[1]}


def replay_writer_id(
    group_id: str, branch: str, table: str, restored: int | None, lost: int
) -> str:
    """A writer id that names one rollback (which table and branch, from which snapshot back
    to which): deterministic, so a retried replay publishes the same (writer id, batch)."""
    key = json.dumps([group_id, branch, table, restored, lost]).encode()
    return f"{REPLAY_PREFIX}{group_id}-{hashlib.sha256(key).hexdigest()[:20]}"


def is_replay_writer(writer_id: str) -> bool:
    """Whether ``writer_id`` publishes a rollback's replay (it never answers StartCommit)."""
    return writer_id.startswith(REPLAY_PREFIX)


def detect(
    group_id: str,
    branch: str,
    table: str,
    restored: Recorded | None,
    lost: Recorded | None,
) -> Rollback | None:
    """The rollback of ``table``, if any: ``lost`` is the state the table property keeps (the
    pipeline's newest commit), given only when its snapshot is not in the branch history;
    ``restored`` the newest state the history still holds."""
    if lost is None or (restored is not None and restored.snapshot_id == lost.snapshot_id):
        return None
    restored_id = None if restored is None else restored.snapshot_id
    return Rollback(
        table=table,
        restored_snapshot_id=restored_id,
        lost_snapshot_id=lost.snapshot_id,
        from_offsets={} if restored is None else restored.source_offsets,
        to_offsets=lost.source_offsets,
        writer_id=replay_writer_id(group_id, branch, table, restored_id, lost.snapshot_id),
    )


def keyed_refusal(table: str, mode: str) -> RollbackNotReplayableError:
    """Why a keyed table's rollback is not replayed, and the way out."""
    return RollbackNotReplayableError(
        f"table '{table}' is in {mode} mode: replaying a rolled-back range would apply old "
        "changes of its keys after newer ones, so icefloe does not replay it. Fix: accept the "
        f"rollback as it is (icefloe rollback --config <pipeline.toml> {table} <snapshot id> "
        "--no-replay; the rolled-back changes stay out) and re-apply the changes you need"
    )


def describe(rollback: Rollback | None, table: str, replay: bool) -> str:
    """What the pipeline will do about ``table`` after ``icefloe rollback``."""
    if rollback is None:
        return (
            f"{table}: nothing to replay"
            + ("" if replay else "; the rolled-back rows stay out (rollback accepted)")
            + ". The pipeline goes on from where it is."
        )
    start = {t: dict(p) for t, p in rollback.from_offsets.items()} or "where it began reading"
    end = {t: dict(p) for t, p in rollback.to_offsets.items()}
    return (
        f"{table}: rolled back from snapshot {rollback.lost_snapshot_id} to "
        f"{rollback.restored_snapshot_id}. A running `icefloe run` of this pipeline re-reads "
        f"the source from {start} up to {end}, writes the rows routed to {table} (no other "
        "table) and commits them once, with the live stream's files of the table, which wait "
        f"until then (replay writer {rollback.writer_id})."
    )
