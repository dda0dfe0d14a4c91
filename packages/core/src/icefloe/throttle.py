"""A client library's log, each message at most once a window (contract: the backends and the
runner hand it to the Kafka clients they build).

Why: librdkafka, retrying a broker it cannot reach, logs the same connect failure at every
reconnect backoff: 55 lines in a 3 s metadata request, 315 before ``icefloe run`` said the
cluster is unreachable, 39 raw stderr lines per ``icefloe status`` when a source is down. The
one error that names the fix was buried under them. Hand-written: :mod:`logging` has no such
filter, and confluent-kafka calls only ``log(level, msg, *args)`` on the object it is given.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

#: how long a message is held back after it was logged
REPEAT_WINDOW_S = 60.0
_REMEMBERED_MESSAGES = 1024
_NUMBERS = re.compile(r"[0-9]+")


class ThrottledLog:
    """Logs into ``logger`` each message (its numbers aside: ports, milliseconds, timestamps)
    at most once a window; the next one let through says how many were held back."""

    def __init__(
        self,
        logger: logging.Logger,
        window_s: float = REPEAT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self._window = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, str], tuple[float, int]] = {}  # -> (logged at, held back)

    def log(self, level: int, msg: str, *args: Any) -> None:
        text = msg % args if args else msg
        key = (level, _NUMBERS.sub("N", text))
        with self._lock:
            now = self._clock()
            logged_at, held = self._seen.get(key, (None, 0))
            if logged_at is not None and now - logged_at < self._window:
                self._seen[key] = (logged_at, held + 1)
                return
            if len(self._seen) >= _REMEMBERED_MESSAGES:
                self._seen.clear()
            self._seen[key] = (now, 0)
        if held:
            text = f"{text} (repeated {held} times since it was last logged)"
        self.logger.log(level, "%s", text)
