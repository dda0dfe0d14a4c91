"""One broadcast consumer per backend (process), shared by all its writers.

Why: a consumer per writer made 256 writers of a process 256 librdkafka clients (each with its
threads and fetch loop), and each writer fetched, under its publish lock, every record of the
control topic to find the coordinator's few broadcasts. Here one reader thread fetches the
control topic, recognises this pipeline's broadcasts by their record key and group header,
decodes each once, and appends it to the inbox of every writer subscribed at that moment
(as the PostgreSQL backend shares one LISTEN connection and Redis one stream reader).

Delivery rule (``Broadcasts`` of docs/backend-authors.md): a writer subscribes inside
``open()``. The reader's fetch position is never past the end of the log, so every broadcast
appended after a subscription is fetched later and dispatched to that inbox; one that was
already fetched may reach it too, which the rule allows. When the consumer fails, the thread
builds a new one at the offsets it had reached, so nothing is skipped. The thread stops with
the last subscriber and starts again (at the log's end) with the next.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from icefloe.errors import ChannelError, EventDecodeError
from icefloe.events import Event, decode_event
from icefloe_kafka.clients import KafkaClients, fetch, header_group, log_bounds, record_key

log = logging.getLogger(__name__)

_FETCH_S = 0.2  # longest consume call: how soon the thread notices it should stop
_RETRY_S = 1.0  # pause before rebuilding a failed consumer
#: broadcasts an inbox keeps for a writer that does not poll (the oldest are dropped, loudly)
INBOX_LIMIT = 10_000


def broadcast_key(group_id: str) -> bytes:
    """The record key of every broadcast of a pipeline (the coordinator's)."""
    return record_key(group_id, "coordinator")


class Inbox:
    """One writer's broadcasts, in the order they were read."""

    def __init__(self, owner: BroadcastReader) -> None:
        self._owner = owner
        self._cond = threading.Condition()
        self._events: deque[Event] = deque()

    def put(self, events: list[Event]) -> None:
        with self._cond:
            self._events.extend(events)
            over = len(self._events) - INBOX_LIMIT
            if over > 0:
                log.warning("a writer did not read its broadcasts: dropping the %d oldest", over)
                for _ in range(over):
                    self._events.popleft()
            self._cond.notify_all()

    def take(self, timeout: float) -> list[Event]:
        """Everything received so far, waiting up to ``timeout`` s for something (0: never)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._events), max(timeout, 0.0))
            out = list(self._events)
            self._events.clear()
            return out

    def close(self) -> None:
        self._owner.unsubscribe(self)


class _Run:
    """One life of the reader thread: its stop flag and the offsets it has reached."""

    def __init__(self, start: dict[int, int]) -> None:
        self.stop = threading.Event()
        self.next = start  # partition -> next offset to read
        self.thread: threading.Thread | None = None


def _stop(run: _Run) -> None:
    run.stop.set()
    if run.thread is not None and run.thread is not threading.current_thread():
        run.thread.join()


class BroadcastReader:
    """The shared reader of one backend; thread-safe."""

    def __init__(self, clients: KafkaClients) -> None:
        self._clients = clients
        self._group_id = clients.group_id
        self._key = broadcast_key(clients.group_id)
        self._lock = threading.Lock()
        self._inboxes: list[Inbox] = []
        self._run: _Run | None = None

    def subscribe(self) -> Inbox:
        """A new inbox; it receives every broadcast appended from now on."""
        inbox = Inbox(self)
        with self._lock:
            if self._run is None:
                self._run = self._start()
            self._inboxes.append(inbox)
        return inbox

    def unsubscribe(self, inbox: Inbox) -> None:
        """Drop ``inbox``; the last one stops the thread and waits until it has closed its
        consumer. Why wait: like a writer's own consumer before, it must be gone when the
        writer's close returns (librdkafka 2.x crashed in a metadata update of a consumer
        still closing while its topic was deleted)."""
        with self._lock:
            with contextlib.suppress(ValueError):  # closed twice
                self._inboxes.remove(inbox)
            run = self._run if not self._inboxes else None
            if run is not None:
                self._run = None
        if run is not None:
            _stop(run)

    def close(self) -> None:
        """Stop the thread and wait for it (the backend is closing)."""
        with self._lock:
            run, self._run = self._run, None
            self._inboxes.clear()
        if run is not None:
            _stop(run)

    # ------------------------------------------------------------------ the thread

    def _start(self) -> _Run:
        """Start reading at the log's end: the high watermark, asked read_uncommitted (see
        ``log_bounds``: read_committed bounds can read as 0 and would replay every broadcast
        ever sent). Raises ChannelError when the broker cannot tell it."""
        topic = self._clients.control_topic
        ends = self._clients.consumer(
            self._clients.consumer_group("writer"), "broadcasts", committed=False
        )
        try:
            start = {
                p: log_bounds(ends, topic, p, self._clients.timeout)[1]
                for p in self._clients.partitions(topic)
            }
        finally:
            ends.close()
        run = _Run(start)
        run.thread = threading.Thread(
            target=self._read, args=(run,), name=f"icefloe-broadcasts-{self._group_id}", daemon=True
        )
        run.thread.start()
        return run

    def _consumer(self, run: _Run) -> Consumer:
        topic = self._clients.control_topic
        consumer = self._clients.consumer(self._clients.consumer_group("writer"), "broadcasts")
        consumer.assign([TopicPartition(topic, p, o) for p, o in run.next.items()])
        return consumer

    def _read(self, run: _Run) -> None:
        consumer: Consumer | None = None
        try:
            while not run.stop.is_set():
                try:
                    if consumer is None:
                        consumer = self._consumer(run)
                    self._dispatch(run, fetch(consumer, 500, _FETCH_S))
                except (ChannelError, KafkaException, RuntimeError) as exc:
                    log.warning("reading broadcasts failed, reading on from where it was: %s", exc)
                    if consumer is not None:
                        with contextlib.suppress(RuntimeError):
                            consumer.close()
                    consumer = None
                    run.stop.wait(_RETRY_S)
        finally:
            if consumer is not None:
                with contextlib.suppress(RuntimeError):
                    consumer.close()

    def _dispatch(self, run: _Run, msgs: list[Message]) -> None:
        """Hand the broadcasts among ``msgs`` to every current inbox; a fatal error is raised
        after the broadcasts read before it were handed over (``run.next`` is past them)."""
        events: list[Event] = []
        failure: ChannelError | None = None
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.fatal():
                    failure = ChannelError(f"reading broadcasts failed: {err.str()}")
                    break
                log.warning("broadcast read error: %s", err.str())
                continue
            run.next[msg.partition() or 0] = (msg.offset() or 0) + 1
            event = self._event(msg)
            if event is not None:
                events.append(event)
        if events:
            with self._lock:
                inboxes = list(self._inboxes) if self._run is run else []
            for inbox in inboxes:
                inbox.put(events)
        if failure is not None:
            raise failure

    def _event(self, msg: Message) -> Event | None:
        """The broadcast ``msg`` carries, or None for every other record (writers' batches
        and answers are skipped undecoded: their key is the writer's)."""
        if msg.key() != self._key or header_group(msg.headers()) != self._group_id:
            return None
        try:
            event = decode_event(msg.value() or b"")
        except EventDecodeError as exc:
            log.warning(
                "skipping undecodable broadcast %s[%s]@%s: %s",
                msg.topic(),
                msg.partition(),
                msg.offset(),
                exc,
            )
            return None
        if event.group_id != self._group_id or event.writer is not None:
            return None
        return event
