"""A Redis writer's end: registers with a growing epoch, publishes a batch through one
epoch-checked, idempotent script, and reads the broadcasts when the shared reader
(:mod:`icefloe_redis.broadcasts`) wakes it."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from icefloe.channel import WriterBatch, WriterChannel
from icefloe.errors import ChannelError, EventDecodeError, WriterFencedError
from icefloe.events import Event, SourcePosition, WriterRef, decode_event, encode_event
from icefloe_redis.broadcasts import FALLBACK_READS, BroadcastWatch
from icefloe_redis.connection import RedisConnection, redis_errors, reply_text

log = logging.getLogger("icefloe_redis.backend")


class RedisStateLostError(WriterFencedError):
    """The writer's registration vanished from Redis: the server restarted without
    persistence (or the keys were deleted), and batches published but not committed are gone.
    The writer must restart from the source offsets committed in the tables."""


def _decode(raw: bytes, where: str) -> Event | None:
    """A broadcast event, or None (logged) for bytes that are not one: a writer only acts on
    StartCommit, so a foreign entry there must not stop it."""
    try:
        return decode_event(raw)
    except EventDecodeError as exc:
        log.warning("skipping undecodable entry %s: %s", where, exc)
        return None


class RedisWriterChannel(WriterChannel):
    """A writer instance: epoch-checked, idempotent publishes through one script."""

    def __init__(
        self, connection: RedisConnection, writer_id: str, broadcasts: BroadcastWatch
    ) -> None:
        self._connection = connection
        self.writer_id = writer_id
        self._epoch: int | None = None
        self._broadcast_after = "0-0"
        self._keys = connection.keys
        self._broadcasts = broadcasts
        self._woken = broadcasts.wakeups.subscribe()

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def open(self) -> int:
        with redis_errors("open"):
            epoch, last_broadcast = self._connection.scripts.open_writer(
                keys=[self._keys.epochs, self._keys.broadcasts], args=[self.writer_id]
            )
        self._epoch = int(epoch)
        self._broadcast_after = reply_text(last_broadcast)
        return self._epoch

    def _check_writer(self, ref: WriterRef | None) -> int:
        """The epoch to publish under; events of an older instance are fenced here."""
        if self._epoch is None:
            raise ChannelError(f"writer '{self.writer_id}': call open() before publishing")
        if ref is None or ref.writer_id != self.writer_id:
            raise ValueError(f"event of writer {ref!r} published through writer '{self.writer_id}'")
        if ref.epoch < self._epoch:
            raise WriterFencedError(
                f"writer '{self.writer_id}' epoch {ref.epoch} is fenced by epoch {self._epoch}"
            )
        if ref.epoch > self._epoch:
            raise ValueError(
                f"writer '{self.writer_id}': event claims epoch {ref.epoch}, "
                f"this instance holds {self._epoch}"
            )
        return self._epoch

    def _run(
        self,
        ref: WriterRef | None,
        batch_seq: str,
        events: Sequence[Event],
        extra: Sequence[str | bytes],
    ) -> bool:
        epoch = self._check_writer(ref)
        for e in events:
            self._check_writer(e.writer)
        keys = self._keys
        args: list[str | bytes] = [self.writer_id, str(epoch), batch_seq, str(len(events))]
        args.extend(encode_event(e) for e in events)
        args.extend(extra)
        with redis_errors("publish"):
            reply = self._connection.scripts.publish(
                keys=[
                    keys.epochs,
                    keys.event_seq,
                    keys.events,
                    keys.batches,
                    keys.batch_floors,
                    keys.sources(self.writer_id),
                ],
                args=args,
            )
        code = reply_text(reply[0])
        if code == "ok":
            return True
        if code == "dup":
            return False
        if code == "fenced":
            raise WriterFencedError(
                f"writer '{self.writer_id}' epoch {epoch} is fenced by epoch {reply_text(reply[1])}"
            )
        if code == "lost":
            raise RedisStateLostError(
                f"writer '{self.writer_id}' of pipeline '{self._connection.group_id}' is no longer "
                f"registered in Redis at {self._connection.config.safe_url}: the server lost its "
                "data (restart without persistence?). Batches published but not committed are "
                "gone: restart the writer from the source offsets committed in the tables (a "
                'new spark.checkpoint_location with source.starting_offsets = "table"); see '
                "docs/backends/redis.md"
            )
        raise ChannelError(
            f"redis stream {keys.events} holds entries icefloe did not write; "
            "use a key_prefix of its own for icefloe"
        )

    def publish(self, batch: WriterBatch) -> bool:
        extra: list[str | bytes] = []
        for p in batch.source_positions:
            extra.append(f"{p.topic}\n{p.partition}")
            extra.append(json.dumps({"offset": p.offset, "max_timestamp_ms": p.max_timestamp_ms}))
        return self._run(batch.writer, str(batch.batch_seq), batch.events, extra)

    def respond(self, event: Event) -> None:
        self._run(event.writer, "", (event,), ())

    def poll_broadcasts(self, timeout: float) -> list[Event]:
        """Read the broadcast stream only when the backend's shared reader saw new entries
        since this writer's last read (or the fallback interval passed): an idle writer waits on its
        flag without a command. The flag is lowered before the read, so an entry added during
        the read raises it again."""
        if self._epoch is None:
            raise ChannelError(f"writer '{self.writer_id}': call open() before polling")
        return self._woken.read(
            self._read_broadcasts,
            self._broadcasts.ensure,
            timeout,
            FALLBACK_READS * self._connection.config.max_block_s,
        )

    def _read_broadcasts(self) -> list[Event]:
        entries = self._connection.read_stream(
            self._keys.broadcasts, self._broadcast_after, 0, 1000
        )
        out: list[Event] = []
        for entry_id, raw in entries:
            self._broadcast_after = entry_id
            event = _decode(raw, f"{self._keys.broadcasts} {entry_id}")
            if event is not None:
                out.append(event)
        return out

    def source_positions(self) -> list[SourcePosition]:
        """The source positions stored with this writer's newest published batches."""
        with redis_errors("HGETALL"):
            stored = self._connection.client.hgetall(self._keys.sources(self.writer_id))
        out = []
        for field, value in stored.items():
            topic, _, partition = reply_text(field).rpartition("\n")
            data = json.loads(value)
            out.append(
                SourcePosition(topic, int(partition), data["offset"], data["max_timestamp_ms"])
            )
        return sorted(out, key=lambda p: (p.topic, p.partition))

    def close(self) -> None:
        """Leave the shared broadcast reader (it stops with its last writer); connections
        belong to the backend's pool."""
        self._woken.close()
