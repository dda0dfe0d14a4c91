"""``icefloe run`` as a service, against a real process tree: a real broker, Spark JVM,
SQLite catalog. Signals go to the process group (what Ctrl-C, systemd and ``timeout`` do) or
to the pid; every case must stop cleanly (exit 0, "stopped cleanly") and leave no JVM behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from pyiceberg.catalog import load_catalog
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField, StringType

from icefloe_kafka.embedded import EmbeddedKafkaBroker

pytestmark = pytest.mark.spark  # `icefloe run` subprocesses start their own JVM

DEADLINE_S = 300.0


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc: no psutil needed)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _is_java(pid: int) -> bool:
    try:
        return b"java" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _pipeline(tmp: Path, broker: EmbeddedKafkaBroker, topic: str) -> tuple[Path, dict[str, str]]:
    catalog = {
        "type": "sql",
        "uri": f"sqlite:///{tmp / 'catalog.db'}",
        "warehouse": f"file://{tmp / 'warehouse'}",
    }
    cat = load_catalog("svc", **catalog)
    cat.create_namespace("svc")
    cat.create_table(
        "svc.events",
        Schema(
            NestedField(1, "id", LongType(), required=False),
            NestedField(2, "name", StringType(), required=False),
        ),
    )
    config: dict[str, Any] = {
        "name": f"svc-{uuid.uuid4().hex[:8]}",
        "source": {
            "bootstrap_servers": broker.bootstrap_servers,
            "topics": [topic],
            "reader_options": {"probeHighWatermark": "true", "pollTimeoutMs": "20000"},
        },
        "tables": [{"name": "svc.events"}],
        "catalog": {"name": "svc", "properties": catalog},
        "coordination": {
            "backend": "kafka",
            "commit_interval_s": 1.0,
            "commit_timeout_s": 10.0,
            "lease_ttl_s": 5.0,
            "kafka": {
                "bootstrap_servers": broker.bootstrap_servers,
                "control_topic": f"ctl-{uuid.uuid4().hex[:8]}",
            },
        },
        "spark": {
            "checkpoint_location": str(tmp / "checkpoint"),
            "trigger_interval_s": 0.5,
            "conf": {
                "spark.ui.enabled": "false",
                "spark.sql.shuffle.partitions": "2",
                "spark.driver.memory": "1g",
            },
        },
    }
    path = tmp / "pipeline.toml"
    path.write_text(tomli_w.dumps(config))
    return path, catalog


def _rows(catalog: dict[str, str]) -> int:
    table = load_catalog("svc", **catalog).load_table("svc.events")
    return table.scan().to_arrow().num_rows


def _start(
    args: list[str], out: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    with out.open("wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "icefloe", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own group, as under a supervisor
        )


def _wait_for(what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], out: Path):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"icefloe exited ({proc.returncode}) before {what}:\n{out.read_text()}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(1.0)
    pytest.fail(f"timed out waiting for {what}:\n{out.read_text()}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_a_jvm_that_does_not_start_is_one_error_quoting_its_output(
    tmp_path: Path, kafka_broker: EmbeddedKafkaBroker, new_topic: Callable[..., str]
) -> None:
    """The JVM's output goes to Spark's log file, so the reason it died must come back in the
    error (else `icefloe run` would only say PySpark's "exited before sending its port")."""
    config, _ = _pipeline(tmp_path, kafka_broker, new_topic(partitions=1))
    text = config.read_text().replace(
        '"spark.driver.memory" = "1g"',
        # Spark adds -XX:+IgnoreUnrecognizedVMOptions: a stack this small fails all the same
        '"spark.driver.memory" = "1g"\n"spark.driver.extraJavaOptions" = "-Xss1k"',
    )
    assert "-Xss1k" in text
    config.write_text(text)
    out = tmp_path / "run.log"
    proc = _start(["run", "--config", str(config), "--quiet"], out)
    try:
        rc = proc.wait(DEADLINE_S)
        text = out.read_text()
        assert rc == 2, text
        assert "error: Spark's JVM did not start" in text, text
        assert "Could not create the Java Virtual Machine" in text, text
        assert "Traceback" not in text, text
    finally:
        _stop(proc)


@pytest.mark.parametrize(
    ("sig", "to_group"),
    [(signal.SIGINT, True), (signal.SIGTERM, True), (signal.SIGTERM, False)],
    ids=["SIGINT-group", "SIGTERM-group", "SIGTERM-pid"],
)
def test_run_stops_cleanly_on_signals(
    tmp_path: Path,
    kafka_broker: EmbeddedKafkaBroker,
    new_topic: Callable[..., str],
    produce: Callable[..., Any],
    sig: signal.Signals,
    to_group: bool,
) -> None:
    topic = new_topic(partitions=2)
    config, catalog = _pipeline(tmp_path, kafka_broker, topic)
    values = [json.dumps({"id": i, "name": f"n{i}"}).encode() for i in range(40)]
    produce(topic, values, partitions=2)
    out = tmp_path / "run.log"
    proc = _start(["run", "--config", str(config), "--quiet"], out)
    try:
        _wait_for("the table to hold every record", lambda: _rows(catalog) == 40, proc, out)
        tree = _children(proc.pid)
        jvms = {p for p in tree if _is_java(p)}
        assert jvms, f"no JVM under icefloe run: {tree}"
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        rc = proc.wait(DEADLINE_S)
        text = out.read_text()
        assert rc == 0, text
        assert "stopped cleanly" in text, text
        # Spark's Python source runner may print a trace when the stopping query closes its
        # socket, and the JVM copies it to its stderr: the JVM's own output (its banner, always
        # printed) goes to Spark's log file, not under "stopped cleanly"
        assert "Traceback" not in text, text
        assert "Using incubator modules" not in text, text
        assert "stopped SparkContext" not in text, text
        # nothing from the tree survives (the JVM exits once stopped; allow it time)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(p) for p in tree):
            time.sleep(0.5)
        assert not [p for p in tree if _alive(p)], f"left behind: {tree}"
        assert _rows(catalog) == 40  # exactly once, read by pyiceberg
    finally:
        _stop(proc)


def test_run_once_catches_up_commits_and_exits_with_metrics(
    tmp_path: Path,
    kafka_broker: EmbeddedKafkaBroker,
    new_topic: Callable[..., str],
    produce: Callable[..., Any],
) -> None:
    """``--once`` reads what is there, commits it and exits 0 on its own; while it runs, the
    Prometheus endpoint serves the counters (scraped for real)."""
    topic = new_topic(partitions=2)
    config, catalog = _pipeline(tmp_path, kafka_broker, topic)
    values = [json.dumps({"id": i, "name": f"n{i}"}).encode() for i in range(30)]
    produce(topic, values, partitions=2)
    out = tmp_path / "once.log"
    port_file = tmp_path / "port"
    port = _free_port()
    port_file.write_text(str(port))
    proc = _start(
        [
            "run",
            "--config",
            str(config),
            "--once",
            "--log-format",
            "json",
            "--metrics-port",
            str(port),
        ],
        out,
    )
    scraped: list[str] = []

    def scrape() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
        scraped.append(body)
        return "icefloe_records_written_total 30.0" in body

    try:
        _wait_for("records_written to reach 30", scrape, proc, out)
        rc = proc.wait(DEADLINE_S)
        text = out.read_text()
        assert rc == 0, text
        assert "stopped cleanly" in text
    finally:
        _stop(proc)
    assert _rows(catalog) == 30
    body = scraped[-1]
    for name in (
        "icefloe_records_read_total",
        "icefloe_files_written_total",
        "icefloe_bytes_written_total",
        "icefloe_commit_cycles_total",
        "icefloe_commit_cycle_seconds_bucket",
        "icefloe_pending_files",
        "icefloe_leadership_changes_total",
    ):
        assert name in body, name
    # --log-format json: every line is one JSON object, Spark's and the JVM's included
    not_json = [line for line in text.splitlines() if not _json_object(line)]
    assert not not_json, "\n".join(not_json)
    # progress without a terminal: JSON lines, one per table commit
    events = [json.loads(line) for line in text.splitlines()]
    assert events[-1]["message"] == "stopped cleanly", events[-1]
    commits = [e for e in events if e.get("event") == "table_commit"]
    assert commits
    assert commits[-1]["table"] == "svc.events"


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_run_stops_with_the_recovery_when_the_channel_changed_without_a_drain(
    tmp_path: Path,
    kafka_broker: EmbeddedKafkaBroker,
    new_topic: Callable[..., str],
    produce: Callable[..., Any],
) -> None:
    """The table's last commit came through another control topic (another channel) that was
    never drained: the driver's coordinator must not retry forever while Spark keeps
    publishing; ``icefloe run`` stops and exits non-zero naming ``icefloe drain``, and the
    table keeps exactly what it had."""
    import tomllib

    from icefloe.testing.fixtures import assert_exactly_once
    from icefloe.testing.harness import RowSource, commit_batches
    from icefloe_kafka import KafkaBackend, KafkaBackendConfig

    topic = new_topic(partitions=2)
    path, catalog_props = _pipeline(tmp_path, kafka_broker, topic)
    config = tomllib.loads(path.read_text())
    catalog = load_catalog("svc", **catalog_props)
    source = RowSource.create(catalog, ["svc.rows"])
    config["tables"] = [{"name": "svc.rows"}]
    old = KafkaBackendConfig(
        bootstrap_servers=kafka_broker.bootstrap_servers, control_topic=f"old-{topic}"
    )
    old_id = commit_batches(
        KafkaBackend(old, config["name"], 5.0), catalog, config["name"], source, range(2)
    )
    committed = source.expected["svc.rows"]
    path.write_text(tomli_w.dumps(config))  # a new control topic: a new channel
    produce(topic, [json.dumps({"id": 10_000 + i}).encode() for i in range(20)], partitions=2)
    out = tmp_path / "run.log"
    proc = _start(["run", "--config", str(path), "--once", "--quiet"], out)
    try:
        rc = proc.wait(DEADLINE_S)
    finally:
        _stop(proc)
    text = out.read_text()
    assert rc not in (0, None), text
    assert "ChannelChangedError" in text or "error: " in text, text
    assert "icefloe drain" in text, text
    assert old_id in text, text
    assert "stopped cleanly" not in text, text
    assert_exactly_once(catalog, "svc.rows", committed)


def _jvm_options(proc: subprocess.Popen[bytes]) -> str:
    """The command line of the JVM under ``proc`` (empty until it runs)."""
    for pid in _children(proc.pid):
        if _is_java(pid):
            with contextlib.suppress(OSError):
                return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def _run_once(config: Path, out: Path, env: dict[str, str]) -> tuple[str, str]:
    """``icefloe run --once`` to its end: (its output, its JVM's command line)."""
    proc = _start(["run", "--config", str(config), "--once"], out, env)
    options: list[str] = []

    def jvm_running() -> bool:
        options.append(_jvm_options(proc))
        return bool(options[-1])

    try:
        _wait_for("the JVM", jvm_running, proc, out)
        rc = proc.wait(DEADLINE_S)
        text = out.read_text()
        assert rc == 0, text
        assert "stopped cleanly" in text, text
    finally:
        _stop(proc)
    return text, options[-1]


def test_the_first_run_keeps_the_jvm_s_class_data_and_the_next_one_maps_it(
    tmp_path: Path,
    kafka_broker: EmbeddedKafkaBroker,
    new_topic: Callable[..., str],
    produce: Callable[..., Any],
) -> None:
    """``icefloe run`` with an empty cache: its JVM writes its class data as it ends, which
    is checked and kept under its size; the next run's JVM maps that file, and writes none."""
    topic = new_topic(partitions=2)
    config, catalog = _pipeline(tmp_path, kafka_broker, topic)
    produce(topic, [json.dumps({"id": i}).encode() for i in range(20)], partitions=2)
    cache = tmp_path / "cache"
    env = {"ICEFLOE_CACHE_DIR": str(cache)}

    text, jvm = _run_once(config, tmp_path / "first.log", env)
    assert "-XX:ArchiveClassesAtExit=" in jvm, jvm
    assert "keeping Spark's class data" in text, text
    kept = sorted((cache / "class-data").iterdir())
    assert [p.suffix for p in kept] == [".jsa"], kept  # nothing half-written is left
    assert kept[0].stat().st_size == int(kept[0].stem.rsplit("-", 1)[1])
    assert _rows(catalog) == 20

    text, jvm = _run_once(config, tmp_path / "second.log", env)
    assert f"-XX:SharedArchiveFile={kept[0]}" in jvm, jvm
    assert "-XX:ArchiveClassesAtExit=" not in jvm, jvm
    assert "keeping Spark's class data" not in text, text
    assert sorted((cache / "class-data").iterdir()) == kept
    assert _rows(catalog) == 20
