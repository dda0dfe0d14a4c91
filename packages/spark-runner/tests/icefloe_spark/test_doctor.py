"""`icefloe doctor` catches what `icefloe run` would reject: a missing table, a missing
topic, Kafka down (in one line, without librdkafka's retry log)."""

from __future__ import annotations

import json
import re
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient
from pyiceberg.catalog import load_catalog
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField

from icefloe.testing.cli import failed_check, run_icefloe, write_config
from icefloe_kafka.embedded import EmbeddedKafkaBroker

pytestmark = pytest.mark.integration  # `icefloe doctor` runs every plugin's checks: servers, Java


def _catalog(tmp_path: Path) -> dict[str, str]:
    return {
        "type": "sql",
        "uri": f"sqlite:///{tmp_path / 'c.db'}",
        "warehouse": f"file://{tmp_path / 'wh'}",
    }


def _config(tmp_path: Path, bootstrap: str, topic: str) -> Path:
    catalog = _catalog(tmp_path)
    return write_config(
        tmp_path / "p.toml",
        {
            "name": "doctor-spark",
            "source": {"bootstrap_servers": bootstrap, "topics": [topic]},
            "tables": [{"name": "db.t"}],
            "catalog": {"name": "c", "properties": catalog},
            "coordination": {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap}},
        },
    )


def _create_table(tmp_path: Path) -> None:
    catalog = load_catalog("c", **_catalog(tmp_path))
    catalog.create_namespace("db")
    catalog.create_table("db.t", Schema(NestedField(1, "id", LongType(), required=False)))


def test_doctor_fails_on_a_missing_table(
    tmp_path: Path, kafka_broker: EmbeddedKafkaBroker, new_topic: Callable[..., str]
) -> None:
    config = _config(tmp_path, kafka_broker.bootstrap_servers, new_topic())
    assert "does not exist" in failed_check(config, "table db.t")


def test_doctor_fails_on_a_missing_topic(tmp_path: Path, kafka_broker: EmbeddedKafkaBroker) -> None:
    _create_table(tmp_path)
    config = _config(tmp_path, kafka_broker.bootstrap_servers, "no-such-topic")
    assert "does not exist" in failed_check(config, "topic no-such-topic")


def test_doctor_fails_in_one_line_when_kafka_is_down(tmp_path: Path) -> None:
    _create_table(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    config = _config(tmp_path, f"127.0.0.1:{port}", "t")
    line = failed_check(config, "kafka source")
    assert f"cannot reach 127.0.0.1:{port} within 2s" in line  # a health check waits <= 2 s
    out = run_icefloe("doctor", "--config", str(config))
    text = out.stdout + out.stderr
    assert "FAIL|" not in text  # librdkafka's per-attempt log stays out
    # one line per check and the summary, nothing else (a fixed line count broke each time a
    # check was added: the storage probe made it 13)
    lines = text.splitlines()
    assert all(ln.startswith(("ok ", "warn ", "fail ")) for ln in lines[:-1]), text
    assert re.fullmatch(r"\d+ failed, \d+ warning\(s\), \d+ ok", lines[-1]), text


def test_doctor_passes_a_setup_run_accepts(
    tmp_path: Path, kafka_broker: EmbeddedKafkaBroker, new_topic: Callable[..., str]
) -> None:
    _create_table(tmp_path)
    config = _config(tmp_path, kafka_broker.bootstrap_servers, new_topic())
    out = run_icefloe("doctor", "--config", str(config))
    text: Any = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "fail " not in text
    assert "ok   java:" in text


def test_status_shows_lag_and_exits_1_when_the_table_is_behind(
    tmp_path: Path,
    kafka_broker: EmbeddedKafkaBroker,
    new_topic: Callable[..., str],
    produce: Callable[..., Any],
) -> None:
    _create_table(tmp_path)
    topic = new_topic(partitions=2)
    config = _config(tmp_path, kafka_broker.bootstrap_servers, topic)
    idle = run_icefloe("status", "--config", str(config), "--json")
    assert idle.returncode == 0, idle.stdout + idle.stderr
    assert json.loads(idle.stdout)["tables"][0]["source_lag"] == 0
    produce(topic, [b'{"id": 1}'] * 5, partitions=2)
    behind = run_icefloe("status", "--config", str(config), "--json")
    assert behind.returncode == 1, behind.stdout + behind.stderr
    table = json.loads(behind.stdout)["tables"][0]
    assert table["source_lag"] == 5
    assert table["stuck"] is True
    assert "no commit yet" in table["reason"]
    text = run_icefloe("status", "--config", str(config))
    assert "table db.t: last commit never" in text.stdout
    assert "lag 5" in text.stdout


def test_doctor_and_status_follow_a_topic_pattern(
    tmp_path: Path,
    kafka_broker: EmbeddedKafkaBroker,
    new_topic: Callable[..., str],
    produce: Callable[..., Any],
) -> None:
    """``source.topic_pattern``: doctor lists the matching topics, the lag counts them only."""
    _create_table(tmp_path)
    prefix = f"dp{uuid.uuid4().hex[:8]}"
    matching = [new_topic(partitions=2, name=f"{prefix}-{i}") for i in (1, 2)]
    other = new_topic(partitions=1, name=f"{prefix}x")
    produce(matching[0], [b'{"id": 1}'] * 3, partitions=2)
    produce(matching[1], [b'{"id": 2}'] * 2, partitions=2)
    produce(other, [b'{"id": 3}'] * 4)
    bootstrap = kafka_broker.bootstrap_servers
    config = write_config(
        tmp_path / "p.toml",
        {
            "name": "doctor-pattern",
            "source": {"bootstrap_servers": bootstrap, "topic_pattern": f"{prefix}-[0-9]+"},
            "tables": [{"name": "db.t"}],
            "catalog": {"name": "c", "properties": _catalog(tmp_path)},
            "coordination": {
                "backend": "kafka",
                "kafka": {"bootstrap_servers": bootstrap, "control_topic": f"ctl-{prefix}"},
            },
        },
    )
    doctor = run_icefloe("doctor", "--config", str(config))
    text = doctor.stdout + doctor.stderr
    assert f"topic pattern {prefix}-[0-9]+: {', '.join(matching)}" in text, text
    status = run_icefloe("status", "--config", str(config), "--json")
    table = json.loads(status.stdout)["tables"][0]
    assert table["source_lag"] == 5, status.stderr
    assert table["pending_files"] == 0  # nothing was ever published
    # status is read-only: it did not create the pipeline's control topic
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert f"ctl-{prefix}" not in admin.list_topics(timeout=20).topics
