"""Reading a channel's backlog to its end, read only: what the resume rules, ``icefloe
maintain`` and ``icefloe status`` read.

A module of its own, importing no pyiceberg (unlike :mod:`.reading`): ``icefloe status``
reads the channel on a thread while its main thread imports pyiceberg, and a thread that
imported pyiceberg's modules at the same time could fail on Python's import locks (a
deadlock error, or a partly initialised module, where modules import each other).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from icefloe.channel import ChannelRecord, CoordinatorChannel
from icefloe.errors import ChannelStalledError

#: How long a read-only read of the backlog may take to reach the channel's end: longer than
#: Kafka's default transaction timeout (60 s), after which the broker aborts a transaction its
#: producer left open, so a read held back by a dead writer's transaction still finishes.
READ_TO_END_S = 120.0
_BACKLOG_POLL_S = 0.5


def short_of(
    read: Mapping[str, int], through: Mapping[str, int] | None, end: Mapping[str, int]
) -> dict[str, tuple[int, int]]:
    """Where a reader stands short of ``end`` (an earlier ``end_position()``): per partition,
    (how far it got, the end). How far it got is the position after the records it was given
    (``read``) or, if further, where its channel says it read through (``through``, from
    ``read_through()``: past log entries that are not events). Empty once it reached the end."""
    reached = dict(read)
    for partition, offset in (through or {}).items():
        reached[partition] = max(reached.get(partition, 0), offset)
    return {p: (reached.get(p, 0), o) for p, o in end.items() if reached.get(p, 0) < o}


def backlog(
    channel: CoordinatorChannel, group_id: str, timeout_s: float = READ_TO_END_S
) -> Iterator[ChannelRecord]:
    """Every event of ``group_id`` the channel holds from its stored position up to its end as
    measured before the read (read only: no lease, nothing stored). What the resume rules,
    ``icefloe maintain`` and ``icefloe status`` read: where a new leader would resume.

    Why to a measured end, never "until a poll finds nothing": an empty poll may only be a
    slow fetch, and a Kafka read_committed reader stands still at a transaction left open while
    committed batches wait behind it. A read cut short misses batches: a writer after a lost
    checkpoint would start below them (their records committed twice), and maintain would
    delete their files. Raises :class:`~icefloe.errors.ChannelStalledError` when the end is
    not reached within ``timeout_s``."""
    end = dict(channel.end_position())
    stored = channel.stored_position()
    read = dict(stored or {})
    channel.seek(stored)
    deadline = time.monotonic() + timeout_s
    while short := short_of(read, channel.read_through(), end):
        if time.monotonic() >= deadline:
            raise ChannelStalledError(stalled(short, timeout_s))
        for rec in channel.poll(_BACKLOG_POLL_S):
            read[rec.partition] = max(read.get(rec.partition, 0), rec.offset + 1)
            if rec.event.group_id == group_id:
                yield rec


def stalled(short: Mapping[str, tuple[int, int]], waited_s: float) -> str:
    """Why a read stands ``short`` (see :func:`short_of`) of the channel's end after
    ``waited_s``."""
    where = ", ".join(f"partition {p}: read to {r}, end {e}" for p, (r, e) in sorted(short.items()))
    return (
        f"the channel holds events no reader gets within {waited_s:.0f}s ({where}): a "
        "transaction left open by another producer (Kafka read_committed; the broker aborts it "
        "after its transaction timeout), or a slow or failing server, holds readers back; the "
        "coordinator cannot commit them either. Nothing was decided from the part read: try "
        "again once the channel reads again"
    )
