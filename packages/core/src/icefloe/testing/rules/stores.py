"""Rules of where a Backend's channels meet: every Backend the factory makes for a pipeline
reaches one shared store, two pipelines of one server never meet, the store has one stable
identity (``channel_id``) that a recreated store does not share, and a recreated store never
issues an epoch or a fencing token again."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from icefloe.channel import Backend
from icefloe.errors import WriterFencedError
from icefloe.events import Event, StartCommit
from icefloe.testing.rules.support import (
    BackendFactory,
    Channels,
    StoreRecreator,
    SuiteBase,
    assert_same_position,
    event_ids,
    make_batch,
    opened_backend,
    position_after,
    rule,
)


class StoreRules(SuiteBase):
    """Shared store, Pipelines are isolated, Identity, Numbering."""

    @rule("Shared store", reports=("Backend.writer", "Backend.coordinator"))
    def test_backends_from_the_factory_share_one_store(
        self, backend: Backend, other_backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """The writer's and the coordinator's Backend objects are different (different
        processes, in production) yet meet in one store: events, epochs, lease, broadcasts."""
        assert other_backend is not backend, "the factory must return a new Backend per call"
        w, ref, batch = self.publish_one(backend, group_id, channels, 0)
        coord, recs = self.read_from_start(other_backend, channels, group_id, event_ids([batch]))
        pos = position_after(recs)
        sent = Event(group_id, StartCommit("shared"))
        coord.broadcast(sent)
        got = self.broadcasts_until(w, lambda evs: sent.event_id in {e.event_id for e in evs})
        assert sent.event_id in {e.event_id for e in got}
        rival = backend.coordinator("rival")
        channels.append(rival)
        assert rival.acquire(0.3) is None, "another Backend object's leader was not seen"
        _, ref2 = self.writer(other_backend, channels, "w")
        assert ref2.epoch > ref.epoch, "another Backend object's writer epoch was not seen"
        with pytest.raises(WriterFencedError):
            w.publish(make_batch(group_id, ref, 1))
        coord.store_position(pos)
        reader = backend.coordinator("reader")
        channels.append(reader)
        assert_same_position(reader.stored_position(), pos)

    @rule("Pipelines are isolated")
    def test_pipelines_are_isolated(
        self, backend: Backend, backend_factory: BackendFactory, group_id: str, channels: Channels
    ) -> None:
        """Same writer id and batch key, leases, positions and broadcasts in two pipelines of
        one server never interfere."""
        other_id = f"{group_id}-other"
        with opened_backend(backend_factory, other_id, self.lease_ttl_s) as other:
            wa, ra = self.writer(backend, channels, "w")
            wb, rb = self.writer(other, channels, "w")
            a, b = make_batch(group_id, ra, 0), make_batch(other_id, rb, 0)
            assert wa.publish(a) is True
            assert wb.publish(b) is True, "a batch key of another pipeline was taken as a replay"
            ca, _ = self.leader(backend, channels, "c")
            cb, _ = self.leader(other, channels, "c")
            ca.seek(None)
            pos = position_after(self.read_until(ca, group_id, self.has_events(event_ids([a]))))
            ca.store_position(pos)
            assert cb.stored_position() is None, "a position stored in another pipeline"
            if not self.shared_log:
                ca.seek(None)
                leaked = [r for r in ca.poll(0.5) if r.event.group_id != group_id]
                assert not leaked, f"poll returned events of another pipeline: {leaked[:3]}"
            ca.broadcast(Event(group_id, StartCommit("a-only")))
            mark = Event(other_id, StartCommit("b-mark"))
            cb.broadcast(mark)
            got = self.broadcasts_until(wb, lambda evs: mark in evs)
            assert all(e.group_id == other_id for e in got), "a broadcast crossed pipelines"

    @rule("Identity", reports=("CoordinatorChannel.channel_id",))
    def test_channel_id_is_one_per_storage_and_stable(
        self, backend_factory: BackendFactory, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """Every process reaching the same storage sees the same identity, before and after
        events were published; it names the backend."""
        first, _ = self.leader(backend, channels, "c1")
        before = first.channel_id()
        assert before
        assert ":" in before, f"channel id {before!r} should start with the backend's name"
        self.publish_batches(backend, group_id, channels, 2)
        with opened_backend(backend_factory, group_id, self.lease_ttl_s) as other:
            second = other.coordinator("c2")
            channels.append(second)
            assert second.channel_id() == before
        assert first.channel_id() == before

    @pytest.fixture
    def recreated(
        self,
        backend_factory: BackendFactory,
        group_id: str,
        channels: Channels,
        recreate_store: StoreRecreator,
    ) -> Callable[[Backend], AbstractContextManager[Backend]]:
        """``with recreated(backend) as fresh``: the channels the test opened closed (the
        processes of the old store are gone), the store of ``backend`` dropped (the test
        class's ``recreate_store``), and a new Backend of the pipeline, which makes it anew."""

        def recreate(backend: Backend) -> AbstractContextManager[Backend]:
            while channels:
                with contextlib.suppress(Exception):  # a fenced channel may fail to close
                    channels.pop().close()
            recreate_store(backend)
            return opened_backend(backend_factory, group_id, self.lease_ttl_s)

        return recreate

    @rule("Identity", reports=("recreate_store",))
    def test_a_recreated_store_is_a_new_channel(
        self,
        backend: Backend,
        channels: Channels,
        recreated: Callable[[Backend], AbstractContextManager[Backend]],
    ) -> None:
        """Two fresh stores have different identities, and neither has the one of the store
        they replaced: an identity that is a constant, or derived from configuration, would
        let positions recorded through a lost store decide what a new one has committed."""
        ids = [self.identity(backend, channels)]
        with recreated(backend) as second:
            ids.append(self.identity(second, channels))
            with recreated(second) as third:
                ids.append(self.identity(third, channels))
        assert len(set(ids)) == 3, f"recreated stores did not get new identities: {ids}"

    @rule("Numbering")
    def test_epochs_and_tokens_grow_across_a_recreated_store(
        self,
        backend: Backend,
        channels: Channels,
        recreated: Callable[[Backend], AbstractContextManager[Backend]],
    ) -> None:
        """Tables keep fencing tokens (and the coordinator the epochs it saw) beyond the life
        of a store: a new store that counted from 1 again would be fenced by its own past,
        or let a zombie of the old one through. Issue them from the clock."""
        _, ref = self.writer(backend, channels, "w")
        _, lease = self.leader(backend, channels, "c")
        with recreated(backend) as fresh:
            _, again = self.writer(fresh, channels, "w")
            _, new_lease = self.leader(fresh, channels, "c")
        assert again.epoch > ref.epoch, (
            f"the recreated store issued epoch {again.epoch} after {ref.epoch}"
        )
        assert new_lease.token > lease.token, (
            f"the recreated store issued fencing token {new_lease.token} after {lease.token}"
        )

    def identity(self, backend: Backend, channels: Channels) -> str:
        """The channel id a new coordinator end of ``backend`` reports (no lease needed)."""
        ch = backend.coordinator("identity")
        channels.append(ch)
        return ch.channel_id()
