"""Rules of how the coordinator reads: positions grow and a seek resumes exactly after a stored
one, a zero timeout does not block, undecodable bytes stop ``poll``, ``end_position`` is
exactly past the newest event and reached by a reader that read everything, and a seek
past it raises ``ChannelResetError``."""

from __future__ import annotations

import threading
import time

import pytest

from icefloe.channel import Backend, ChannelRecord
from icefloe.coordination.backlog import backlog
from icefloe.errors import ChannelResetError, EventDecodeError
from icefloe.events import DataComplete, Event, StartCommit
from icefloe.testing.rules.support import (
    Channels,
    SuiteBase,
    assert_same_position,
    event_ids,
    make_batch,
    position_after,
    rule,
)


class ReadingRules(SuiteBase):
    """Order and positions (one reader), Zero timeouts do not block, Bytes, End position."""

    @rule(
        "Order and positions",
        reports=(
            "CoordinatorChannel.seek",
            "CoordinatorChannel.poll",
            "CoordinatorChannel.store_position",
            "CoordinatorChannel.stored_position",
        ),
    )
    def test_positions_grow_and_seek_resumes_exactly_after_stored_position(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        batches = self.publish_batches(backend, group_id, channels, 6)
        coord, _ = self.leader(backend, channels, "c1")
        assert coord.stored_position() is None, "a new pipeline has no stored position"
        coord.seek(None)
        recs = self.read_until(coord, group_id, self.has_events(event_ids(batches)))
        cut = len(recs) // 2
        pos = position_after(recs[:cut])
        coord.store_position(pos)
        assert_same_position(coord.stored_position(), pos)
        coord.release()
        coord2, _ = self.leader(backend, channels, "c2")
        stored = coord2.stored_position()
        assert_same_position(stored, pos)
        assert stored is not None
        coord2.seek(stored)
        expected = [r for r in recs if not r.is_before(pos)]
        again = self.read_until(
            coord2, group_id, self.has_events({r.event.event_id for r in expected})
        )
        assert [r.event.event_id for r in again] == [r.event.event_id for r in expected]
        assert [(r.partition, r.offset) for r in again] == [
            (r.partition, r.offset) for r in expected
        ]

    @rule("Zero timeouts do not block")
    def test_zero_timeout_polls_do_not_block(self, backend: Backend, channels: Channels) -> None:
        """A zero timeout means "do not wait" (not "wait forever", as some clients read 0):
        the writer client polls broadcasts this way while holding its publish lock."""
        w, _ = self.writer(backend, channels, "w")
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        returned = threading.Event()

        def polls() -> None:
            w.poll_broadcasts(0.0)
            coord.poll(0.0)
            returned.set()

        threading.Thread(target=polls, daemon=True).start()
        assert returned.wait(self.read_timeout_s), "poll with timeout 0 did not return"

    @rule("Bytes", reports=("Backend.inject_undecodable",))
    def test_poll_stops_at_undecodable_bytes(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """A record that does not decode raises EventDecodeError from ``poll`` - on every poll,
        at that record - and is never skipped: what follows it may be a DataWritten the
        coordinator must not lose."""
        w, ref = self.writer(backend, channels, "w")
        before = make_batch(group_id, ref, 0)
        after = make_batch(group_id, ref, 1)
        assert w.publish(before) is True
        backend.inject_undecodable(b"\x00\xffnot an icefloe event", "w")
        assert w.publish(after) is True
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        got: list[ChannelRecord] = []
        deadline = time.monotonic() + self.read_timeout_s
        raised = 0
        while raised < 2:
            if time.monotonic() > deadline:
                pytest.fail(
                    "poll never raised EventDecodeError for the injected bytes "
                    f"(read {len(got)} records): it skips undecodable records"
                )
            try:
                got.extend(r for r in coord.poll(0.2) if r.event.group_id == group_id)
            except EventDecodeError:
                raised += 1  # and again: the record is not consumed by raising
            seen = {r.event.event_id for r in got}
            assert not seen & event_ids([after]), "poll skipped the undecodable record"
        assert event_ids([before]) <= {r.event.event_id for r in got}, (
            "events before the undecodable record were not returned first"
        )

    @rule("End position", reports=("CoordinatorChannel.end_position",))
    def test_end_position_is_past_every_event_read(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """``end_position`` is the reset detector's yardstick: positions a reader reaches
        (and tables record) never lie beyond it."""
        batches = self.publish_batches(backend, group_id, channels, 3)
        coord, recs = self.read_from_start(backend, channels, group_id, event_ids(batches))
        end = coord.end_position()
        for partition, offset in position_after(recs).items():
            assert end.get(partition, 0) >= offset, (
                f"end {dict(end)} is behind {partition}@{offset}"
            )

    @rule("End position")
    def test_a_reader_that_read_everything_reaches_end_position(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """The converse: every read-only read of the backlog (a writer's resume, ``icefloe
        maintain``, ``icefloe status``) and ``icefloe drain`` read to the ``end_position()``
        measured before they start, counting ``read_through()``; an end that reading everything
        never reaches (batches, a broadcast and an answer behind it) leaves them refusing with
        ChannelStalledError."""
        w, ref = self.writer(backend, channels, "w")
        batches = [make_batch(group_id, ref, seq) for seq in range(3)]
        for b in batches:
            assert w.publish(b) is True
        coord, _ = self.leader(backend, channels, "c")
        coord.broadcast(Event(group_id, StartCommit("cycle-1")))
        w.respond(Event(group_id, DataComplete((), "cycle-1"), ref))
        reader = backend.coordinator("reader")
        channels.append(reader)
        got = list(backlog(reader, group_id, timeout_s=self.read_timeout_s))
        assert event_ids(batches) <= {r.event.event_id for r in got}

    @rule("End position")
    def test_a_reader_with_nothing_left_to_read_reaches_end_position(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """A store that numbers from the clock holds no event below its first offset, and a
        prune removes what was committed: a reader from the start that finds nothing left has
        still read through ``end_position()`` (say so in ``read_through()``), or every writer
        start and ``icefloe maintain`` of a pipeline with nothing pending waits for events
        that do not exist and gives up with ChannelStalledError."""
        self.writer(backend, channels, "w")  # a writer and a leader may create the counters
        self.leader(backend, channels, "c")
        reader = backend.coordinator("reader")
        channels.append(reader)
        assert list(backlog(reader, group_id, timeout_s=self.read_timeout_s)) == []

    @rule("End position")
    def test_end_position_is_not_past_the_newest_event(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """A reader that read everything reaches ``end_position``: ``icefloe drain`` proves a
        channel empty that way, and a stall detector would report a gap that never closes.
        Reached counts ``read_through()`` where the backend has one (log entries that are not
        events, as Kafka's transaction markers)."""
        batches = self.publish_batches(backend, group_id, channels, 3)
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        read: list[ChannelRecord] = []  # every record, of other pipelines too (shared logs)
        deadline = time.monotonic() + self.read_timeout_s
        while True:
            end = coord.end_position()
            reached = position_after(read)
            for partition, offset in (coord.read_through() or {}).items():
                reached[partition] = max(reached.get(partition, 0), offset)
            mine = {r.event.event_id for r in read if r.event.group_id == group_id}
            if event_ids(batches) <= mine and all(reached.get(p, 0) >= o for p, o in end.items()):
                return
            if time.monotonic() > deadline:
                pytest.fail(
                    f"read everything there is (reached {reached}), yet end_position() says "
                    f"{dict(end)}: it lies past the newest event"
                )
            read.extend(coord.poll(0.2))

    @rule("End position")
    def test_seek_past_the_end_raises_channel_reset(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """A position past the end was recorded by a store that held more events: this one
        was rolled back or recreated, and reading on would number new events below what
        tables recorded. ``seek`` raises, before anything is read."""
        self.publish_batches(backend, group_id, channels, 2)
        coord, _ = self.leader(backend, channels, "c")
        past = {p: o + 5 for p, o in coord.end_position().items()} or {"0": 5}
        with pytest.raises(ChannelResetError):
            coord.seek(past)
