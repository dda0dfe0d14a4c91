"""The live view of `icefloe run` on a real terminal (a pseudo terminal, rendered by a
terminal emulator): log lines above the view, whole; one view; the rate of records published."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pyte

HERE = Path(__file__).resolve().parent
COLUMNS, ROWS = 100, 40


def run_on_terminal(args: list[str], timeout: float = 60.0) -> list[str]:
    """Run ``args`` with a pseudo terminal as stdin, stdout and stderr; the screen it leaves."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": str(COLUMNS), "LINES": str(ROWS), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    screen = pyte.Screen(COLUMNS, ROWS)
    stream = pyte.ByteStream(screen)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                stream.feed(data)
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=10) == 0, "\n".join(screen.display)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return [line.rstrip() for line in screen.display]


def test_log_lines_go_above_the_live_view_whole_and_the_view_is_drawn_once(
    tmp_path: Path,
) -> None:
    screen = run_on_terminal([sys.executable, str(HERE / "live_view_proc.py"), str(tmp_path)])
    text = "\n".join(screen)
    logged = [ln for ln in screen if "log line" in ln]
    assert len(logged) == 6, text
    for i, line in enumerate(logged):  # each on its own line, nothing glued to it
        assert line.endswith(f" INFO icefloe_spark.pipeline: log line {i} of the pipeline"), text
    headers = [ln for ln in screen if ln.startswith("icefloe pty")]
    assert len(headers) == 1, text  # no stale copies of the view
    assert screen.index(headers[0]) > screen.index(logged[-1]), text  # the view stays below
    assert "0 records/s" in headers[0], text  # nothing was published: no made-up rate
    assert [ln for ln in screen if ln.startswith("db.t")], text


def test_rate_is_records_published_over_the_last_seconds() -> None:
    from icefloe_spark.cli.progress import PublishRate

    rate = PublishRate(window_s=10.0)
    assert rate.update(0, now=100.0) == 0.0
    assert rate.update(0, now=105.0) == 0.0  # idle batches publish nothing
    assert rate.update(5_000, now=110.0) == 500.0  # 5,000 in the last 10 s
    assert rate.update(5_000, now=115.0) == 5_000 / 10.0  # the window still holds them
    assert rate.update(5_000, now=121.0) == 0.0  # nothing new for a whole window
