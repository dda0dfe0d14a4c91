"""Run the real ``icefloe`` command in a child process (tests of what an operator sees)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(extra or {}), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def run_icefloe(
    *args: str, timeout: float = 180.0, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m icefloe ARGS`` with wide, colourless output (``env``: variables added to
    this process's environment); never raises on exit status."""
    env = _child_env(env)
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


def pipeline_file(directory: Path, coordination: dict[str, Any], name: str = "p") -> Path:
    """``directory/pipeline.toml``: one table in a SQLite catalog under ``directory``, a Kafka
    source nobody serves (port 9), and this ``[coordination]`` table."""
    from icefloe.testing.fixtures import sqlite_catalog_properties

    catalog = {"type": "sql", **sqlite_catalog_properties(directory / "catalog")}
    return write_config(
        directory / "pipeline.toml",
        {
            "name": name,
            "source": {"bootstrap_servers": "127.0.0.1:9", "topics": ["t"]},
            "tables": [{"name": "db.t"}],
            "catalog": {"name": "c", "properties": catalog},
            "coordination": coordination,
        },
    )


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


def operator_outputs(
    config: Path,
    metrics_port: int,
    env: Mapping[str, str] | None = None,
    commands: tuple[str, ...] = ("show-config", "doctor", "status"),
    lead_s: float = 1.0,
) -> dict[str, str]:
    """What an operator sees of a pipeline, by what produced it: the output of each of
    ``commands`` (``doctor`` verbose), then a standalone ``coordinator``'s debug log and its
    Prometheus page, ``lead_s`` after it said it started (SIGTERM then), or its output when it
    fails to start. For tests that grep every output for a secret."""
    out: dict[str, str] = {}
    for name in commands:
        args = (name, "-v") if name == "doctor" else (name,)
        done = run_icefloe(*args, "--config", str(config), env=env)
        out[name] = done.stdout + done.stderr
    log = config.with_suffix(".coordinator.log")
    command = [sys.executable, "-m", "icefloe", "coordinator", "--config", str(config)]
    command += ["--log-level", "debug", "--metrics-port", str(metrics_port)]
    with log.open("w") as sink:
        proc = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, text=True, env=_child_env(env)
        )
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and "started" not in log.read_text():
            assert time.monotonic() < deadline, f"the coordinator did not start: {log.read_text()}"
            time.sleep(0.1)
        time.sleep(lead_s if proc.poll() is None else 0)
        out["metrics"] = ""
        if proc.poll() is None:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as page:
                out["metrics"] = page.read().decode()
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out["coordinator"] = log.read_text()
    return out


def assert_run_hides(outputs: Mapping[str, str], secret: str, backend: str) -> None:
    """``outputs`` (of :func:`operator_outputs`) are those of a real run on ``backend`` (doctor
    reached the server, the coordinator started and served metrics), and none shows
    ``secret``."""
    assert f"ok   backend {backend} server: reachable" in outputs["doctor"], outputs["doctor"]
    assert "started" in outputs["coordinator"], outputs["coordinator"]
    assert "icefloe_" in outputs["metrics"]
    for name, text in outputs.items():
        assert secret not in text, f"the secret shows in the output of {name}"
