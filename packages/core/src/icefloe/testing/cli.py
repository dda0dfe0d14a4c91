"""Run the real ``icefloe`` command in a child process (tests of what an operator sees)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import tomli_w


def run_icefloe(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """``python -m icefloe ARGS`` with wide, colourless output; never raises on exit status."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-m", "icefloe", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def write_config(path: Path, data: dict[str, Any]) -> Path:
    """A pipeline TOML file from a dict."""
    path.write_text(tomli_w.dumps(data))
    return path


def failed_check(config: Path, check: str) -> str:
    """Run `icefloe doctor`; assert it exits 1 with exactly one line for ``check``, a
    failure; return that line."""
    out = run_icefloe("doctor", "--config", str(config))
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    lines = [line for line in text.splitlines() if f" {check}:" in line]
    assert len(lines) == 1, text
    assert lines[0].startswith("fail"), text
    assert "Traceback" not in text, text
    return lines[0]
