"""Stall detection: the channel's end moves on while the coordinator's read position does not.

Seen on the bundled test broker (a read_committed reader held back for minutes behind an
advancing topic by a transaction that never ends); any backend can stall the same way (a lost
consumer assignment, a server bug). Without a check the coordinator just waits: nothing fails,
nothing commits. :class:`StallWatch` is the pure rule; the coordinator feeds it the read and end
positions and reports what it says (log warning, ``icefloe_channel_stalled_seconds``).
"""

from __future__ import annotations

from collections.abc import Mapping


class StallWatch:
    """Says for how long the end has been ahead of an unmoving read position.

    The clock starts when the end is first seen to move past where it was when the read
    position last changed, not when the read position last changed: an idle coordinator whose
    channel just received an event is not stalled, it has not polled yet. Resets whenever the
    read position moves or the caller says the reader is held back on purpose (its memory
    bound). An end that stands one offset ahead for good (a Kafka transaction marker, which
    takes an offset but is never delivered) is no stall: it does not move.
    """

    def __init__(self, after_s: float) -> None:
        if after_s <= 0:
            raise ValueError(f"after_s must be positive (got {after_s})")
        self.after_s = after_s
        self._read: dict[str, int] | None = None
        self._end_then: dict[str, int] = {}
        self._ahead_since: float | None = None

    def observe(
        self, read: Mapping[str, int], end: Mapping[str, int], now: float, held: bool = False
    ) -> float | None:
        """Seconds the channel has been stalled at ``now`` (monotonic seconds), once that is at
        least ``after_s``; else None."""
        read = dict(read)
        if held or read != self._read:
            self._read, self._end_then, self._ahead_since = read, dict(end), None
            return None
        moved = any(o > self._end_then.get(p, 0) for p, o in end.items())
        behind = any(o > read.get(p, 0) for p, o in end.items())
        if not (moved and behind):
            self._ahead_since = None
            return None
        if self._ahead_since is None:
            self._ahead_since = now
        stalled = now - self._ahead_since
        return stalled if stalled >= self.after_s else None
