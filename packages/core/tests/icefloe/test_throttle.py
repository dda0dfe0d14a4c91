"""The throttled client-library log (:mod:`icefloe.throttle`): the window, with a fake clock."""

from __future__ import annotations

import logging

import pytest

from icefloe.throttle import ThrottledLog

pytestmark = pytest.mark.unit


def test_a_held_back_message_is_counted_when_it_is_logged_again() -> None:
    """The window is per message, numbers aside; the next line let through says how many were
    held back."""
    now = [0.0]
    logger = logging.getLogger("test.throttle")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        log = ThrottledLog(logger, window_s=60.0, clock=lambda: now[0])
        for t in (0.0, 1.0, 2.0, 59.0):
            now[0] = t
            log.log(
                logging.ERROR, "%s [%s] %s", "FAIL", "c#1", f"connect to :{9000 + int(t)} failed"
            )
        log.log(logging.ERROR, "%s", "another message")
        log.log(logging.WARNING, "%s", "another message")  # another level is another message
        now[0] = 61.0
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "c#1", "connect to :9100 failed")
    finally:
        logger.removeHandler(handler)
    assert seen == [
        "FAIL [c#1] connect to :9000 failed",
        "another message",
        "another message",
        "FAIL [c#1] connect to :9100 failed (repeated 3 times since it was last logged)",
    ]
