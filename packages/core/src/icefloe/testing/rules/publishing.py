"""Rules of what a writer publishes: epochs fence older instances of a writer, a batch becomes
visible whole and in order, and a re-published batch key adds nothing or exact duplicates."""

from __future__ import annotations

import pytest

from icefloe.channel import Backend
from icefloe.errors import WriterFencedError
from icefloe.events import DataComplete, Event
from icefloe.testing.rules.support import (
    Channels,
    SuiteBase,
    event_ids,
    events_of,
    make_batch,
    rule,
)


class PublishingRules(SuiteBase):
    """Epochs and fencing, Atomic batches, Idempotent batches."""

    @rule(
        "Epochs and fencing",
        reports=("WriterChannel.open", "WriterChannel.respond", "WriterChannel.close"),
    )
    def test_open_fences_older_instances_with_growing_epochs(
        self, backend: Backend, channels: Channels
    ) -> None:
        _, r1 = self.writer(backend, channels, "w")
        _, r2 = self.writer(backend, channels, "w")
        _, r3 = self.writer(backend, channels, "w")
        assert r1.epoch < r2.epoch < r3.epoch

    @rule("Epochs and fencing")
    def test_fenced_writer_publishes_nothing(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        old, old_ref = self.writer(backend, channels, "w")
        new, new_ref = self.writer(backend, channels, "w")
        stale = make_batch(group_id, old_ref, 1)
        with pytest.raises(WriterFencedError):
            old.publish(stale)
        with pytest.raises(WriterFencedError):
            old.respond(Event(group_id, DataComplete((), "c"), old_ref, None))
        marker = make_batch(group_id, new_ref, 2)
        assert new.publish(marker) is True
        _, recs = self.read_from_start(backend, channels, group_id, event_ids([marker]))
        seen = {r.event.event_id for r in recs}
        assert not seen & {e.event_id for e in stale.events}, "a fenced publish became visible"
        assert all(r.event.writer == new_ref for r in recs)

    @rule("Atomic batches", reports=("WriterChannel.publish",))
    def test_batches_are_whole_ordered_and_contiguous_per_writer(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        writers = [self.writer(backend, channels, f"w{i}") for i in range(2)]
        published: dict[str, list[str]] = {ref.writer_id: [] for _, ref in writers}
        for seq in range(5):
            for ch, ref in writers:
                batch = make_batch(group_id, ref, seq, tables=("ns.a", "ns.b"))
                assert ch.publish(batch) is True
                published[ref.writer_id].extend(e.event_id for e in batch.events)
        wanted = {i for ids in published.values() for i in ids}
        _, recs = self.read_from_start(backend, channels, group_id, wanted)
        for writer_id, ids in published.items():
            # exactly the published events, each once, in publish order: every batch is whole
            # and no other batch of this writer sits inside it
            assert events_of(recs, writer_id) == ids
        by_partition: dict[str, list[int]] = {}
        for r in recs:
            by_partition.setdefault(r.partition, []).append(r.offset)
        for offsets in by_partition.values():
            assert offsets == sorted(offsets)
            assert len(set(offsets)) == len(offsets)

    @rule("Idempotent batches")
    def test_republishing_a_batch_adds_nothing_or_exact_duplicates(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        first, _, batch = self.publish_one(backend, group_id, channels, 7)
        again = first.publish(batch)
        # a restarted instance replays the same batch key (what Spark does after a crash)
        second, ref2 = self.writer(backend, channels, "w")
        replay = make_batch(group_id, ref2, 7)
        replayed = second.publish(replay)
        marker = make_batch(group_id, ref2, 8)
        assert second.publish(marker) is True
        _, recs = self.read_from_start(backend, channels, group_id, event_ids([marker]))
        ids = [r.event.event_id for r in recs]
        for e in batch.events:
            assert ids.count(e.event_id) == 1 + int(again), "re-publish must be all or nothing"
        for e in replay.events:
            assert ids.count(e.event_id) == int(replayed)
        seven = [r for r in recs if r.event.batch_seq == 7]
        assert len(seven) == len(batch.events) * (1 + int(again) + int(replayed))
