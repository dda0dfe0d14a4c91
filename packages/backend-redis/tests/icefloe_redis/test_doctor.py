"""`icefloe doctor` with the Redis backend, as an operator runs it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from icefloe.testing.cli import failed_check, write_config

pytestmark = pytest.mark.integration  # `icefloe doctor` runs every plugin's checks: servers, Java


def test_doctor_with_redis_down_fails(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    config = write_config(
        tmp_path / "p.toml",
        {
            "name": "doctor-redis",
            "source": {"bootstrap_servers": "127.0.0.1:9", "topics": ["t"]},
            "tables": [{"name": "db.t"}],
            "coordination": {"backend": "redis", "redis": {"url": f"redis://127.0.0.1:{port}/0"}},
        },
    )
    assert "Connection refused" in failed_check(config, "backend redis server")
