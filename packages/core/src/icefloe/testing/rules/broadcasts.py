"""Rules of the coordinator's broadcasts: they reach every writer opened before them, in order,
and are kept for a writer that polls late (after ``prune`` and many later broadcasts)."""

from __future__ import annotations

from icefloe.channel import Backend
from icefloe.events import CommitComplete, Event, StartCommit
from icefloe.testing.rules.support import (
    Channels,
    SuiteBase,
    event_ids,
    position_after,
    rule,
)


class BroadcastRules(SuiteBase):
    """Broadcasts, and the part of Retention that keeps them."""

    @rule("Broadcasts", reports=("WriterChannel.poll_broadcasts", "CoordinatorChannel.broadcast"))
    def test_broadcasts_reach_writers_opened_before_them(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        writers = [self.writer(backend, channels, f"w{i}")[0] for i in range(2)]
        coord, _ = self.leader(backend, channels, "c")
        sent = [
            Event(group_id, StartCommit("c-1")),
            Event(group_id, CommitComplete("c-1", 123)),
        ]
        for e in sent:
            coord.broadcast(e)
        want = [e.event_id for e in sent]
        for w in writers:
            got = self.broadcasts_until(w, lambda evs: set(want) <= {e.event_id for e in evs})
            mine = [e.event_id for e in got if e.group_id == group_id]
            assert mine == want
            assert got[0].payload == StartCommit("c-1")

    @rule("Retention")
    def test_broadcasts_are_kept_for_writers_opened_before_them(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """A writer busy with a long batch polls late: every broadcast sent after it opened is
        still there, also after ``prune`` and many later broadcasts."""
        w, _, batch = self.publish_one(backend, group_id, channels, 0)
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        sent = [Event(group_id, StartCommit("kept-0"))]
        coord.broadcast(sent[0])
        pos = position_after(self.read_until(coord, group_id, self.has_events(event_ids([batch]))))
        coord.store_position(pos)
        coord.prune(pos)
        for i in range(1, 50):
            sent.append(Event(group_id, CommitComplete(f"kept-{i}", i)))
            coord.broadcast(sent[-1])
        want = [e.event_id for e in sent]
        got = self.broadcasts_until(w, lambda evs: len(evs) >= len(want))
        assert [e.event_id for e in got if e.group_id == group_id] == want, (
            "broadcasts were lost or reordered before a writer opened earlier read them"
        )
