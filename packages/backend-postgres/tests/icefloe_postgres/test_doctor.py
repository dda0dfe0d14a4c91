"""`icefloe doctor` and `icefloe status` with the PostgreSQL backend, as an operator runs
them."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from icefloe.testing.cli import failed_check, run_icefloe, write_config

pytestmark = pytest.mark.integration  # `icefloe doctor` runs every plugin's checks: servers, Java


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends


def _config(tmp_path: Path, dsn: str) -> Path:
    return write_config(
        tmp_path / "p.toml",
        {
            "name": "doctor-pg",
            "source": {"bootstrap_servers": "127.0.0.1:9", "topics": ["t"]},
            "tables": [{"name": "db.t"}],
            "catalog": {
                "name": "c",
                "properties": {"type": "sql", "uri": f"sqlite:///{tmp_path / 'c.db'}"},
            },
            "coordination": {"backend": "postgres", "postgres": {"dsn": dsn}},
        },
    )


def test_doctor_with_postgres_down_says_connection_refused_once(tmp_path: Path) -> None:
    dsn = f"postgresql://root@127.0.0.1:{_closed_port()}/test"
    line = failed_check(_config(tmp_path, dsn), "backend postgres server")
    assert "Connection refused" in line
    assert "PoolTimeout" not in line


def test_doctor_with_postgres_up_checks_the_server(tmp_path: Path, pg_dsn: str) -> None:
    out = run_icefloe("doctor", "--config", str(_config(tmp_path, pg_dsn)))
    text = out.stdout + out.stderr
    assert "ok   backend postgres server: reachable" in text, text
    assert "fail table db.t" in text  # the table is missing: run would fail
    assert out.returncode == 1


def test_describe_reports_the_leader_token_and_writers(make_backend: Any) -> None:
    backend = make_backend()
    assert backend.describe().leader is None
    writer = backend.writer("w-1")
    writer.open()
    coordinator = backend.coordinator("coord-a")
    lease = coordinator.acquire(5.0)
    assert lease is not None
    state = backend.describe()
    assert state.leader == "coord-a"
    assert state.token == lease.token
    assert state.writers == ("w-1",)
    assert state.lease_age_s is not None
    assert state.lease_age_s >= 0
    assert state.lease_expires_in_s is not None
    assert 0 < state.lease_expires_in_s <= 5.0
    coordinator.close()
    writer.close()


def test_status_exits_1_when_a_table_is_missing(tmp_path: Path, pg_dsn: str) -> None:
    out = run_icefloe("status", "--config", str(_config(tmp_path, pg_dsn)), "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    state = json.loads(out.stdout)
    assert state["stuck"] is True
    assert state["backend_error"] is None
    assert state["tables"][0]["exists"] is False
