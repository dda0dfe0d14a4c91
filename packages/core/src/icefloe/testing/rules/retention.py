"""Rules of ``prune``: it drops only events before the given position, and the batch keys it
drops events of stay known, so a writer's replay after a restart is still recognised."""

from __future__ import annotations

from icefloe.channel import Backend, ChannelPosition
from icefloe.testing.rules.support import (
    Channels,
    SuiteBase,
    event_ids,
    make_batch,
    position_after,
    rule,
)


class RetentionRules(SuiteBase):
    """Retention of events and batch keys (that of broadcasts: :mod:`.broadcasts`)."""

    @rule("Retention", reports=("CoordinatorChannel.prune",))
    def test_prune_drops_only_events_before_the_position(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        batches = self.publish_batches(backend, group_id, channels, 4)
        coord, recs = self.read_from_start(backend, channels, group_id, event_ids(batches))
        cut = len(recs) // 2
        pos: ChannelPosition = position_after(recs[:cut])
        coord.store_position(pos)
        dropped = coord.prune(pos)
        assert dropped >= 0
        coord.seek(None)
        kept = [r for r in recs if not r.is_before(pos)]
        again = self.read_until(coord, group_id, self.has_events({r.event.event_id for r in kept}))
        before = [r for r in again if r.is_before(pos)]
        assert len(before) <= cut
        if dropped:
            assert len(before) <= cut - min(dropped, cut), "prune reported drops it did not make"

    @rule("Retention")
    def test_batch_keys_survive_prune(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """A writer replays its last batches after a restart, possibly after the coordinator
        committed and pruned them: the key must still be known (or, for backends that cannot
        check keys, the replay yields exact duplicates the coordinator drops)."""
        w, ref = self.writer(backend, channels, "w")
        batches = [make_batch(group_id, ref, seq) for seq in range(3)]
        for b in batches:
            assert w.publish(b) is True
        checks_keys = w.publish(batches[-1]) is False
        coord, read = self.read_from_start(backend, channels, group_id, event_ids(batches))
        pos = position_after(read)
        coord.store_position(pos)
        coord.prune(pos)
        w2, ref2 = self.writer(backend, channels, "w")
        replays = [make_batch(group_id, ref2, seq) for seq in range(3)]
        accepted = [w2.publish(b) for b in replays]
        marker = make_batch(group_id, ref2, 3)
        assert w2.publish(marker) is True
        coord.seek(pos)
        recs = self.read_until(coord, group_id, self.has_events(event_ids([marker])))
        if checks_keys:
            assert accepted == [False] * 3, "a pruned batch key was forgotten"
            assert not {r.event.event_id for r in recs} & event_ids(replays)
        else:
            ids = [r.event.event_id for r in recs]
            for b, ok in zip(replays, accepted, strict=True):
                for e in b.events:
                    assert ids.count(e.event_id) == int(ok)
