"""Wake-up flags for the many writers of one process that share one reader of broadcasts.

Why: a writer's responder polls for broadcasts several times a second. With one server
connection (or one query) per writer and poll, 256 writers of a process cost hundreds of
connections or thousands of queries a second while nothing happens. Backends instead run one
reader per process (a LISTEN connection, a blocking stream read) that raises every
subscriber's flag when something arrived; a writer queries only when its flag is up (or when a
fallback interval passed), and waits on the flag without a query or a spin.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Wakeups:
    """The flags of one shared reader's subscribers; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._flags: set[Flag] = set()

    def subscribe(self) -> Flag:
        flag = Flag(self)
        with self._cond:
            self._flags.add(flag)
        return flag

    def unsubscribe(self, flag: Flag) -> int:
        """Drop ``flag``; returns how many subscribers are left."""
        with self._cond:
            self._flags.discard(flag)
            return len(self._flags)

    def __len__(self) -> int:
        with self._cond:
            return len(self._flags)

    def wake_all(self) -> None:
        """Something may have arrived: every subscriber looks once."""
        with self._cond:
            for flag in self._flags:
                flag.up = True
            self._cond.notify_all()


class Flag:
    """One subscriber's "look again" flag."""

    def __init__(self, owner: Wakeups) -> None:
        self._owner = owner
        self.up = True  # a new subscriber looks once: it may have missed something
        self._next_read = 0.0  # when the fallback read is due

    def take(self) -> bool:
        """Lower the flag; True if it was up."""
        with self._owner._cond:
            was, self.up = self.up, False
            return was

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the flag, then lower it; True if it was up."""
        with self._owner._cond:
            self._owner._cond.wait_for(lambda: self.up, max(timeout, 0.0))
            was, self.up = self.up, False
            return was

    def read(
        self,
        read: Callable[[], list[T]],
        watching: Callable[[], bool],
        timeout: float,
        fallback_s: float,
    ) -> list[T]:
        """``read()`` when the flag is up, when ``watching()`` says the shared reader is not
        running, or every ``fallback_s``; else wait on the flag, up to ``timeout`` s in all.
        The flag is lowered before each read, so what arrives during a read raises it again."""
        deadline = time.monotonic() + max(0.0, timeout)
        woken = self.take()
        while True:
            live = watching()
            if woken or not live or time.monotonic() >= self._next_read:
                self._next_read = time.monotonic() + fallback_s
                out = read()
                if out:
                    return out
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            if live:
                woken = self.wait(remaining)
            else:
                time.sleep(min(remaining, fallback_s))
                woken = False

    def close(self) -> int:
        return self._owner.unsubscribe(self)
