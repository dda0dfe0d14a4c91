"""Rules of the coordinator's broadcasts: they reach every writer opened before them, in order,
and are kept for a writer that polls late (after ``prune`` and many later broadcasts)."""

from __future__ import annotations

from icefloe.channel import Backend
from icefloe.events import CommitComplete, CommitToTable, Event, StartCommit
from icefloe.testing.rules.support import (
    BackendFactory,
    Channels,
    SuiteBase,
    event_ids,
    opened_backend,
    position_after,
    rule,
)

#: the lease of the backend that sends 1,200 broadcasts: long enough on any machine
LONG_LEASE_S = 120.0


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

    @rule("Broadcasts")
    def test_broadcast_all_reaches_writers_in_order_once(
        self, backend_factory: BackendFactory, group_id: str, channels: Channels
    ) -> None:
        """A cycle's CommitToTable events go out together (one per table, up to 500 a call:
        ``icefloe.coordination.cycle.BROADCAST_CHUNK``): each reaches every writer once, in
        order, between the broadcasts sent before and after them. On a backend whose lease
        outlasts the sending: this rule is about order, not speed (with the suite's short
        lease a backend sending them one by one, each checking the lease, failed under load)."""
        with opened_backend(backend_factory, group_id, LONG_LEASE_S) as backend:
            writers = [self.writer(backend, channels, f"w{i}")[0] for i in range(2)]
            coord, _ = self.leader(backend, channels, "c")
            first = Event(group_id, StartCommit("c-all"))
            many = [Event(group_id, CommitToTable("c-all", f"db.t{i}", i, 7)) for i in range(1200)]
            last = Event(group_id, CommitComplete("c-all", 7))
            coord.broadcast(first)
            coord.broadcast_all(many[:500])
            coord.broadcast_all(many[500:])  # over 500 in one call too
            coord.broadcast_all([])
            coord.broadcast(last)
            want = [e.event_id for e in [first, *many, last]]
            for w in writers:
                got = self.broadcasts_until(
                    w, lambda evs: last.event_id in {e.event_id for e in evs}
                )
                assert [e.event_id for e in got if e.group_id == group_id] == want, (
                    "broadcast_all lost, repeated or reordered events"
                )
            assert got[1].payload == many[0].payload

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
