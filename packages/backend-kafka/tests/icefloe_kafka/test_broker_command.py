"""`icefloe broker`: the bundled Kafka-protocol broker for trying icefloe on your own topics,
run as an operator would (the real command in a child process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from icefloe.testing.cli import run_icefloe
from icefloe_kafka.embedded import free_port

pytestmark = pytest.mark.integration  # starts a broker without the session fixture


@contextmanager
def broker_command(*args: str) -> Iterator[subprocess.Popen[str]]:
    """``icefloe broker ARGS`` in the foreground of a child process; stopped with SIGINT (what
    Ctrl-C sends) if the test has not stopped it."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "icefloe", "broker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=20)


def test_broker_serves_your_own_topic_and_stops_on_ctrl_c() -> None:
    port = free_port()
    with broker_command("--port", str(port)) as proc:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # blocks until the broker accepts connections
        assert first.strip() == f"bootstrap servers: 127.0.0.1:{port}", first
        producer = Producer({"bootstrap.servers": f"127.0.0.1:{port}"})
        producer.produce("my-events", b'{"id": 1}', partition=0)
        assert producer.flush(20) == 0
        consumer = Consumer(
            {
                "bootstrap.servers": f"127.0.0.1:{port}",
                "group.id": "broker-test",
                "enable.auto.commit": False,
            }
        )
        try:
            consumer.assign([TopicPartition("my-events", 0, OFFSET_BEGINNING)])
            msg = None
            for _ in range(40):
                msg = consumer.poll(0.5)
                if msg is not None and msg.error() is None:
                    break
            assert msg is not None
            assert msg.error() is None
            assert msg.value() == b'{"id": 1}'
        finally:
            consumer.close()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "topics kept in memory: stopping the broker loses every topic" in err, err
    assert "Traceback" not in err, err
    with pytest.raises(ConnectionRefusedError):  # the broker process is gone with the command
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_broker_on_a_port_in_use_names_the_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_icefloe("broker", "--port", str(port), timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"port {port} on 127.0.0.1 is in use: pass --port" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_broker_data_dir_says_why_it_cannot_persist(tmp_path: Path) -> None:
    """The bundled binary keeps topics in memory only: asked to keep them on disk, the command
    refuses with the reason and the fix instead of silently losing them later."""
    out = run_icefloe("broker", "--port", str(free_port()), "--data-dir", str(tmp_path), timeout=60)
    assert out.returncode == 2, out.stderr
    assert "cannot keep topics on disk" in out.stderr, out.stderr
    assert "run without --data-dir" in out.stderr, out.stderr
    assert "set ICEFLOE_TANSU_BIN to a tansu built with" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
