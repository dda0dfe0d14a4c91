"""A Redis coordinator's end: a lease with a fencing token that only grows (checked and
written by script), reads of the events stream (positions as :mod:`icefloe_redis.backend`
describes them), and fenced broadcasts and positions."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from icefloe.channel import ChannelPosition, ChannelRecord, CoordinatorChannel, Lease
from icefloe.errors import ChannelError, ChannelResetError, EventDecodeError, NotLeaderError
from icefloe.events import Event, decode_event, encode_event
from icefloe_redis.connection import RedisConnection, redis_errors, reply_text

log = logging.getLogger("icefloe_redis.backend")
# events per broadcast script call: one round trip each, and a bound on the script's arguments
_BROADCAST_CHUNK = 500

PARTITION = "0"


def _offset_of(entry_id: Any) -> int | None:
    """The offset of an event stream id ``0-<offset>``; None for ids this backend never
    writes."""
    ms, _, seq = reply_text(entry_id).partition("-")
    if ms != "0" or not seq.isdigit():
        return None
    return int(seq)


class RedisCoordinatorChannel(CoordinatorChannel):
    """A coordinator: leases and fencing by script, reads by XREAD."""

    def __init__(
        self, connection: RedisConnection, coordinator_id: str, lease_ttl_s: float
    ) -> None:
        # unique per instance: two channels with one coordinator_id must not share a lease
        self._holder = f"{coordinator_id}#{uuid.uuid4().hex[:12]}"
        self._connection = connection
        self.coordinator_id = coordinator_id
        self._lease: Lease | None = None
        self._after = "0-0"
        self._keys = connection.keys
        self._ttl_ms = max(1, int(lease_ttl_s * 1000))

    @property
    def lease(self) -> Lease | None:
        return self._lease

    def acquire(self, timeout: float) -> Lease | None:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            started = time.monotonic()
            with redis_errors("acquire"):
                reply = self._connection.scripts.acquire(
                    keys=[self._keys.lease, self._keys.token], args=[self._holder, self._ttl_ms]
                )
            code = reply_text(reply[0])
            if code in ("ok", "held"):
                token = int(reply[1])
                if code == "ok":
                    log.info(
                        "coordinator %s leads pipeline %s with fencing token %d",
                        self.coordinator_id,
                        self._connection.group_id,
                        token,
                    )
                self._lease = Lease(token, self.coordinator_id, started + self._ttl_ms / 1000)
                return self._lease
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            pttl = int(reply[2])
            # the holder may release early, so look again at least every 250 ms
            wait = 0.25 if pttl < 0 else max(pttl, 5) / 1000
            time.sleep(min(remaining, wait, 0.25))

    def _require_lease(self) -> Lease:
        if self._lease is None:
            raise NotLeaderError(f"coordinator {self.coordinator_id} does not hold the lease")
        return self._lease

    def _lost(self, what: str) -> NotLeaderError:
        lease = self._lease
        self._lease = None
        token = lease.token if lease else "-"
        return NotLeaderError(
            f"coordinator {self.coordinator_id} (token {token}) lost the lease of pipeline "
            f"'{self._connection.group_id}': {what}"
        )

    def renew(self) -> Lease:
        lease = self._require_lease()
        started = time.monotonic()
        with redis_errors("renew"):
            reply = self._connection.scripts.renew(
                keys=[self._keys.lease, self._keys.token],
                args=[self._holder, str(lease.token), self._ttl_ms],
            )
        if reply_text(reply[0]) != "ok":
            raise self._lost("another coordinator took over or the lease expired")
        self._lease = Lease(lease.token, lease.holder, started + self._ttl_ms / 1000)
        return self._lease

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        with redis_errors("release"):
            self._connection.scripts.release(
                keys=[self._keys.lease], args=[self._holder, str(lease.token)]
            )

    def seek(self, position: ChannelPosition | None) -> None:
        """A position past the end of the stream was reached in a store that held more events
        (an older RDB snapshot loaded, the counter rolled back): refuse it (rule End position
        of docs/backend-authors.md)."""
        nxt = 0 if position is None else int(position.get(PARTITION, 0))
        if position is not None and nxt > (end := self.end_position()[PARTITION]):
            raise ChannelResetError(
                f"the stored position {nxt} lies past the end of {self._keys.events} ({end}): "
                "the keys were restored from an older snapshot or the event counter rolled "
                "back, and events published before are gone. Do not restart as is: see "
                "docs/operations.md (channel reset)"
            )
        self._after = f"0-{nxt - 1}" if nxt > 0 else "0-0"

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        """Events after the read position. An entry that is not an icefloe event stops the
        read there (EventDecodeError, raised by the poll that reaches it first): skipping it
        could skip a DataWritten, which is silent data loss."""
        entries = self._connection.read_stream(self._keys.events, self._after, timeout, max_records)
        out: list[ChannelRecord] = []
        for entry_id, raw in entries:
            try:
                offset = _offset_of(entry_id)
                if offset is None:
                    raise EventDecodeError(f"stream id {entry_id} was not written by icefloe")
                event = decode_event(raw)
            except EventDecodeError as exc:
                if out:
                    return out
                raise EventDecodeError(
                    f"entry {entry_id} of {self._keys.events} is not an icefloe event ({exc}); "
                    "delete it (XDEL) to let the coordinator continue"
                ) from exc
            self._after = entry_id
            out.append(ChannelRecord(PARTITION, offset, event))
        return out

    def _fenced_call(self, what: str, script: Any, key: str, *args: Any) -> Any:
        """Run a script that writes only while this coordinator is still the leader."""
        lease = self._require_lease()
        with redis_errors(what):
            reply = script(
                keys=[self._keys.lease, self._keys.token, key],
                args=[self._holder, str(lease.token), *args],
            )
        if reply_text(reply[0]) == "stale":
            raise self._lost(f"{what} refused: a newer fencing token exists")
        return reply

    def broadcast(self, event: Event) -> None:
        self.broadcast_all([event])

    def broadcast_all(self, events: Sequence[Event]) -> None:
        """A script call per chunk of events (each call is a round trip; a chunk bounds the
        script's arguments)."""
        for start in range(0, len(events), _BROADCAST_CHUNK):
            self._fenced_call(
                "broadcast",
                self._connection.scripts.broadcast,
                self._keys.broadcasts,
                self._connection.config.broadcast_max_len,
                *(encode_event(e) for e in events[start : start + _BROADCAST_CHUNK]),
            )

    def store_position(self, position: ChannelPosition) -> None:
        data = json.dumps({str(k): int(v) for k, v in position.items()}, sort_keys=True)
        self._fenced_call(
            "store_position", self._connection.scripts.store_position, self._keys.position, data
        )

    def stored_position(self) -> ChannelPosition | None:
        with redis_errors("GET position"):
            raw = self._connection.client.get(self._keys.position)
        if raw is None:
            return None
        data: dict[str, int] = json.loads(raw)
        return data

    def prune(self, before: ChannelPosition) -> int:
        """Trim events before ``before``, never past the stored (committed) position and
        keeping ``retain_committed_events``."""
        stored = self.stored_position()
        if stored is None:
            return 0
        upto = min(int(before.get(PARTITION, 0)), int(stored.get(PARTITION, 0)))
        upto -= self._connection.config.retain_committed_events
        if upto <= 1:
            return 0
        keys = self._keys
        with redis_errors("prune"):
            trimmed = self._connection.scripts.prune(
                keys=[keys.events, keys.batches, keys.batch_floors], args=[str(upto)]
            )
        return int(trimmed)

    def channel_id(self) -> str:
        key = self._keys.channel_id
        with redis_errors("channel id"):
            self._connection.client.set(key, uuid.uuid4().hex, nx=True)
            raw = self._connection.client.get(key)
        if raw is None:  # deleted between the two calls: storage is being wiped right now
            raise ChannelError(f"redis key {key} vanished while it was read; retry")
        return f"redis:{reply_text(raw)}"

    def end_position(self) -> ChannelPosition:
        with redis_errors("GET event-seq"):
            raw = self._connection.client.get(self._keys.event_seq)
        return {PARTITION: 0 if raw is None else int(raw) + 1}

    def close(self) -> None:
        try:
            self.release()
        except ChannelError as exc:
            log.warning("coordinator %s could not release its lease: %s", self.coordinator_id, exc)
