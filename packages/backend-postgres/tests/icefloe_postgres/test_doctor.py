"""`icefloe doctor` with the PostgreSQL backend, as an operator runs it."""

from __future__ import annotations

import socket
from pathlib import Path

from icefloe.testing.cli import failed_check, run_icefloe, write_config


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
