"""Rules of the coordinator lease: one leader at a time with a fencing token that grows across
takeovers, a stale or second leader refused, re-acquire, release and close, takeover after the
leader dies or pauses, and a lease deadline on this process's monotonic clock."""

from __future__ import annotations

import time

from icefloe.channel import Backend
from icefloe.events import Event, StartCommit
from icefloe.testing.rules.support import (
    BackendFactory,
    Channels,
    SuiteBase,
    assert_same_position,
    event_ids,
    opened_backend,
    position_after,
    refused,
    rule,
)


class LeadershipRules(SuiteBase):
    """One leader, Lease clock."""

    @rule(
        "One leader",
        reports=(
            "CoordinatorChannel.acquire",
            "CoordinatorChannel.renew",
            "CoordinatorChannel.release",
            "CoordinatorChannel.close",
        ),
    )
    def test_single_leader_with_growing_fencing_token(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        _, _, batch = self.publish_one(backend, group_id, channels, 1)
        c1, l1 = self.leader(backend, channels, "c1")
        c2 = backend.coordinator("c2")
        channels.append(c2)
        assert c2.acquire(0.3) is None, "a second coordinator got the lease of a live leader"
        assert c1.renew().token == l1.token
        c1.seek(None)
        pos = position_after(self.read_until(c1, group_id, self.has_events(event_ids([batch]))))
        c1.store_position(pos)
        c1.release()
        l2 = c2.acquire(self.read_timeout_s)
        assert l2 is not None
        assert l2.token > l1.token
        refused(
            c1.renew,
            lambda: c1.broadcast(Event(group_id, StartCommit("stale"))),
            lambda: c1.store_position({p: o + 100 for p, o in pos.items()}),
        )
        assert_same_position(c2.stored_position(), pos)
        c2.release()
        l3 = c1.acquire(self.read_timeout_s)
        assert l3 is not None
        assert l3.token > l2.token

    @rule("One leader")
    def test_lease_takeover_after_leader_dies(self, backend: Backend, channels: Channels) -> None:
        c1, l1 = self.leader(backend, channels, "c1")
        c1.simulate_crash()
        self.take_over(backend, channels, "c2", l1, "no takeover after the leader died")

    @rule("One leader")
    def test_paused_leader_is_fenced_after_takeover(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """A leader that stops renewing (a long GC pause) and wakes up after another took over
        must fail to renew, broadcast or store a position."""
        c1, l1 = self.leader(backend, channels, "c1")
        c1.store_position({"0": 0})
        c2, _ = self.take_over(
            backend, channels, "c2", l1, "no takeover after the leader stopped renewing"
        )
        refused(
            lambda: c1.store_position({"0": 1}),
            lambda: c1.broadcast(Event(group_id, StartCommit("zombie"))),
            lambda: c1.broadcast_all([Event(group_id, StartCommit(f"z-{i}")) for i in range(3)]),
            c1.renew,
        )
        assert_same_position(c2.stored_position(), {"0": 0})

    @rule("One leader")
    def test_reacquire_by_the_leader_keeps_the_lease(
        self, backend: Backend, channels: Channels
    ) -> None:
        c1, l1 = self.leader(backend, channels, "c1")
        again = c1.acquire(self.read_timeout_s)
        assert again is not None, "the leader could not re-acquire its own lease"
        assert again.token >= l1.token
        c2 = backend.coordinator("c2")
        channels.append(c2)
        assert c2.acquire(0.3) is None, "a re-acquire let a second coordinator in"
        assert c1.renew().token == again.token

    @rule("One leader")
    def test_release_and_close_free_the_lease_before_it_expires(
        self, backend_factory: BackendFactory, group_id: str, channels: Channels
    ) -> None:
        """With a lease far longer than the test waits, only a real release lets the next
        coordinator in."""
        long_ttl = max(120.0, self.read_timeout_s * 4)
        with opened_backend(backend_factory, group_id, long_ttl) as b:
            c1, l1 = self.leader(b, channels, "c1")
            c1.release()
            refused(c1.renew)
            c2, l2 = self.take_over(b, channels, "c2", l1, "release() did not free the lease")
            c2.close()
            self.take_over(b, channels, "c3", l2, "close() did not release the lease")

    @rule("One leader")
    def test_two_channels_with_one_coordinator_id_are_two_contenders(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """A restarted process reuses its coordinator id; it must not inherit the lease."""
        c1, _ = self.leader(backend, channels, "same")
        c2 = backend.coordinator("same")
        channels.append(c2)
        assert c2.acquire(0.3) is None, "a second channel with the same id got a live lease"
        refused(
            c2.renew,
            lambda: c2.store_position({"0": 1}),
            lambda: c2.broadcast(Event(group_id, StartCommit("same"))),
        )
        c1.renew()

    @rule("Lease clock")
    def test_lease_expires_at_is_a_local_monotonic_deadline(
        self, backend: Backend, channels: Channels
    ) -> None:
        before = time.monotonic()
        c, lease = self.leader(backend, channels, "c")
        renewed = c.renew()
        after = time.monotonic()
        for got in (lease, renewed):
            assert before < got.expires_at <= after + self.lease_ttl_s + 5.0, (
                f"Lease.expires_at {got.expires_at} is not a time.monotonic() deadline of this "
                f"process (now {after}, lease TTL {self.lease_ttl_s}s)"
            )
