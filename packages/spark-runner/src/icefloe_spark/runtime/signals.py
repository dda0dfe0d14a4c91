"""Stopping on SIGINT and SIGTERM the way a supervisor expects: the first signal asks for a
clean stop (exit 0), a second one forces (exit 128 + signal number).

Supervisors signal the whole process group (Ctrl-C, systemd's default ``KillMode``,
``timeout``, container runtimes). The Spark JVM must not get that signal, or it dies under the
running query: :func:`icefloe_spark.pipeline.build_session` starts it in a session of its own,
and this handler stops the query, the coordinator and then Spark, in that order.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger("icefloe_spark.signals")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Owns SIGINT/SIGTERM while installed: the first sets ``stop``, the second calls
    ``force`` (default: kill the Spark JVM and exit at once)."""

    def __init__(self, stop: threading.Event, force: Callable[[int], None] | None = None):
        self.stop = stop
        self.received: int | None = None
        self._force = force or force_exit
        self._previous: dict[int, Any] = {}

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            self._force(signum)
            return
        self.received = signum
        self.stop.set()
        log.warning(
            "%s received: stopping cleanly (send it again to force)", signal.Signals(signum).name
        )

    def install(self) -> None:
        """(Re)take both signals; call again after anything that installs its own handler
        (PySpark's SparkContext replaces the SIGINT handler)."""
        for sig in SIGNALS:
            old = signal.signal(sig, self.handler)
            self._previous.setdefault(sig, old)

    def restore(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()


def force_exit(signum: int) -> None:
    """Kill the Spark JVM (it runs in its own session, so nothing else will) and exit."""
    log.error("second %s: forcing exit", signal.Signals(signum).name)
    kill_spark_jvm()
    os._exit(128 + signum)


def kill_spark_jvm() -> None:
    """SIGKILL the gateway JVM this process started, if any (an orphan JVM would keep ports,
    memory and the checkpoint's files busy)."""
    try:
        from pyspark import SparkContext
    except ImportError:  # pragma: no cover - the runner always has pyspark
        return
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[StopSignals]:
    """SIGINT and SIGTERM set ``stop`` (a clean shutdown) instead of killing the driver."""
    signals = StopSignals(stop)
    signals.install()
    try:
        yield signals
    finally:
        signals.restore()
