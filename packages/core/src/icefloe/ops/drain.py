"""Draining a channel: commit everything it still holds, then record in every table that the
channel is empty, so the pipeline may continue on another channel (a swapped backend).
"Every table" is every table the pipeline commits to: ``icefloe drain`` passes
:func:`icefloe.ops.tables.pipeline_tables` (``[[tables]]``, the dead-letter table, the dynamic
tables the group committed to), and the drain adds each table its own cycles committed.

Why a separate step: positions number the events of one channel only, so a pipeline that
moves to a new channel cannot tell from the tables which batches of the old one were never
committed. The committer therefore refuses to commit through a new channel until the table
names the old one as drained (``icefloe.channel-drained.<group>``, see
:func:`icefloe.commit.summary.drained_property`), and only this procedure sets that mark after
proving the old channel has nothing left.

The writers must be stopped first (``icefloe run`` ended): a batch published while the drain
finishes could land after the mark and be left behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from icefloe.commit.committer import IcebergCommitter
from icefloe.coordination.coordinator import Coordinator
from icefloe.errors import IcefloeError

log = logging.getLogger("icefloe.drain")


class DrainError(IcefloeError):
    """The channel could not be drained (a table kept failing, or the deadline passed)."""


@dataclass(frozen=True)
class DrainResult:
    """What a drain did: the drained channel and the tables marked with it."""

    channel_id: str
    cycles: int
    marked: tuple[str, ...]
    skipped: tuple[str, ...]  # tables whose last commit came through another channel


def drain(
    coordinator: Coordinator,
    committer: IcebergCommitter,
    tables: Iterable[str] | Callable[[], Iterable[str]],
    timeout_s: float = 600.0,
    quiet_s: float = 1.0,
) -> DrainResult:
    """Lead, read the channel to its end and commit everything pending, then mark every table
    in ``tables`` and every table a cycle of the drain committed as drained of this channel.
    ``tables`` may be a function, called once the channel is drained, so that it finds the
    tables the drain committed to for the first time (e.g. by the group's table property).

    "Read to its end" is proven against ``end_position()``, never by a poll that found nothing
    new: the coordinator's own broadcasts (and Kafka's transaction markers) keep adding to a
    channel that carries them in its log (Kafka's control topic), and a poll that returns
    nothing may only be a slow fetch. Cycles ask no writer (they are stopped), and run only
    when the reader caught up or hit the memory bound. ``quiet_s`` is the longest single read.

    Raises :class:`DrainError` when a table fails to commit or ``timeout_s`` passes. A
    rolled-back table whose replay batch was not read yet is not a failure before the channel
    is read to its end (under the memory bound a cycle may run before it gets there)."""
    deadline = time.monotonic() + timeout_s

    def check_deadline(what: str) -> None:
        if time.monotonic() > deadline:
            raise DrainError(f"drain did not finish within {timeout_s:.0f}s ({what})")

    channel = coordinator.channel
    cycles = 0
    committed: set[str] = set()  # tables the drain's cycles held files of
    while True:
        if not coordinator.is_leader:  # at first, or after losing the lease: elect, recover
            check_deadline("waiting for the lease; stop the pipeline's other coordinators")
            coordinator.step(0.2)
            continue
        check_deadline(f"still pending: {coordinator.pending_files()}")
        end = channel.end_position()  # writers are stopped: every batch lies before it
        coordinator.read(quiet_s)
        caught_up = coordinator.caught_up(end)
        if not coordinator.is_leader or not (caught_up or coordinator.pending_full()):
            continue  # read on
        cycle = coordinator.commit_now(wait_for_writers=False)  # also stores the position
        cycles += 1
        committed.update(r.table for r in cycle.tables)
        # a cycle the memory bound ran before the reader caught up may find a rolled-back
        # table's files waiting for a replay batch further in the channel: read on to it;
        # once caught up, a replay still missing was never published, and that fails
        waiting = not caught_up and all(map(coordinator.awaiting_replay, cycle.failed))
        if cycle.failed and not waiting:
            raise DrainError(
                f"channel {channel.channel_id()} cannot be drained: tables failed to commit: "
                f"{dict(cycle.failed)}; fix them and run the drain again"
            )
        if caught_up and not coordinator.pending_files():
            break
    channel_id = channel.channel_id()
    marked: list[str] = []
    skipped: list[str] = []
    named = tables() if callable(tables) else tables
    for table in dict.fromkeys([*named, *sorted(committed)]):
        (marked if committer.mark_drained(table, channel_id) else skipped).append(table)
    log.info("drained channel %s in %d cycles; marked %s", channel_id, cycles, marked)
    return DrainResult(channel_id, cycles, tuple(marked), tuple(skipped))
