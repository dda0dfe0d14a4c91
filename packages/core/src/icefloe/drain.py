"""Draining a channel: commit everything it still holds, then record in every table that the
channel is empty, so the pipeline may continue on another channel (a swapped backend).

Why a separate step: positions number the events of one channel only, so a pipeline that
moves to a new channel cannot tell from the tables which batches of the old one were never
committed. The committer therefore refuses to commit through a new channel until the table
names the old one as drained (``icefloe.channel-drained.<group>``, see
:func:`icefloe.committer.drained_property`), and only this procedure sets that mark after
proving the old channel has nothing left.

The writers must be stopped first (``icefloe run`` ended): a batch published while the drain
finishes could land after the mark and be left behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from icefloe.committer import IcebergCommitter
from icefloe.coordinator import Coordinator
from icefloe.errors import IcefloeError

log = logging.getLogger(__name__)


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
    tables: Sequence[str],
    timeout_s: float = 600.0,
    quiet_s: float = 1.0,
) -> DrainResult:
    """Lead, commit until a poll of ``quiet_s`` finds nothing new and nothing is pending,
    then mark every table in ``tables`` as drained of this channel.

    Raises :class:`DrainError` when a table fails to commit or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s

    def check_deadline(what: str) -> None:
        if time.monotonic() > deadline:
            raise DrainError(f"drain did not finish within {timeout_s:.0f}s ({what})")

    while not coordinator.is_leader:
        check_deadline("waiting for the lease; stop the pipeline's other coordinators")
        coordinator.step(0.2)
    channel_id = coordinator.channel.channel_id()
    cycles = 0
    while True:
        check_deadline(f"still pending: {coordinator.pending_files()}")
        before = coordinator.read_position
        coordinator.step(quiet_s)  # reads whatever the channel still holds
        if not coordinator.is_leader:
            continue  # lost the lease: it recovers and re-reads on the next step
        quiet = coordinator.read_position == before
        cycle = coordinator.commit_now()  # also stores the position read so far
        cycles += 1
        if cycle.failed:
            raise DrainError(
                f"channel {channel_id} cannot be drained: tables failed to commit: "
                f"{dict(cycle.failed)}; fix them and run the drain again"
            )
        if quiet and not coordinator.pending_files():
            break
    marked: list[str] = []
    skipped: list[str] = []
    for table in tables:
        (marked if committer.mark_drained(table, channel_id) else skipped).append(table)
    log.info("drained channel %s in %d cycles; marked %s", channel_id, cycles, marked)
    return DrainResult(channel_id, cycles, tuple(marked), tuple(skipped))
