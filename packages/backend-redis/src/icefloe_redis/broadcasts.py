"""The one reader of a pipeline's broadcast stream that every writer of a backend (process)
shares: it wakes the writers when entries arrive, and they read the stream themselves."""

from __future__ import annotations

import logging
import threading

from icefloe.wakeups import Wakeups
from icefloe_redis.connection import RedisConnection, redis_errors, reply_text, stream_entries

log = logging.getLogger("icefloe_redis.backend")

#: a writer whose flag stays down still reads the broadcasts once per this many max_block_s
#: (a safety net: the shared reader wakes everyone on any failure of its own)
FALLBACK_READS = 5


class BroadcastWatch:
    """One blocking reader of the broadcast stream for every writer of a backend (process).

    Why: each writer's responder polls several times a second; with an XREAD per writer and
    poll, 256 idle writers cost 0.58 cores. This thread blocks in ``XREAD BLOCK`` (at most
    ``max_block_s`` at a time) on the stream's newest entry and raises every subscribed
    writer's flag when entries arrive; writers read the stream themselves only when their flag
    is up (or, as a fallback, every ``FALLBACK_READS`` x ``max_block_s``). It starts from the
    stream's last id read before it wakes everyone, so every later entry wakes the writers; on
    an error it wakes everyone (they read once) and ends; the next writer's poll restarts it.
    """

    def __init__(self, connection: RedisConnection) -> None:
        self._connection = connection
        self.wakeups = Wakeups()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def ensure(self) -> bool:
        """Start the reader thread when it is not running; False once closed."""
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="icefloe-redis-broadcasts", daemon=True
                )
                self._thread.start()
            return True

    def _run(self) -> None:
        c = self._connection
        key = c.keys.broadcasts
        block_ms = max(1, int(c.config.max_block_s * 1000))
        try:
            with redis_errors("XREVRANGE"):
                last = c.client.xrevrange(key, count=1)
            after = reply_text(last[0][0]) if last else "0-0"
            self.wakeups.wake_all()  # entries up to ``after`` are found by the writers' reads
            while True:
                with self._lock:
                    if self._closed or not len(self.wakeups):
                        self._thread = None
                        return
                with redis_errors("XREAD"):
                    reply = c.client.xread({key: after}, count=1000, block=block_ms)
                if reply:
                    after = reply_text(stream_entries(reply)[-1][0])
                    self.wakeups.wake_all()
        except Exception as exc:  # any failure: the writers fall back to polling
            with self._lock:
                self._thread = None
                closed = self._closed
            if not closed:
                log.warning("redis broadcast reader stopped (%s); writers poll meanwhile", exc)
            self.wakeups.wake_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.wakeups.wake_all()
