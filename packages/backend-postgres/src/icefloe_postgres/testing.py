"""Test helpers: a private PostgreSQL server that tests may stop and start, and a test config.

Used by this package's tests and the cross-package tests; not needed at run time.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from icefloe.testing.tls import TlsFiles, self_signed_cert
from icefloe_postgres.backend import PostgresBackend
from icefloe_postgres.config import PostgresConfig

#: ``make_backend(group_id=None, lease_ttl_s=5.0, **config_overrides)``
BackendMaker = Callable[..., PostgresBackend]


def make_test_config(dsn: str, schema: str, **overrides: Any) -> PostgresConfig:
    """Small pool, no retention, short fallback polling: what lean tests want."""
    values: dict[str, Any] = {
        "dsn": dsn,
        "schema": schema,
        "pool_min_size": 0,
        "pool_max_size": 4,
        "retention_s": 0.0,
        "broadcast_retention_s": 0.0,
        "poll_interval_s": 0.5,
        "retry_timeout_s": 20.0,
        **overrides,
    }
    return PostgresConfig.model_validate(values)


def drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        found = [p for p in [shutil.which(name)] if p]
    if not found:
        raise FileNotFoundError(f"PostgreSQL server binary {name!r} not found (install postgresql)")
    return found[-1]


class PrivatePostgres:
    """A throw-away PostgreSQL server on a free port, for tests that stop and start it.

    initdb refuses to run as root, so as root the server runs as the ``postgres`` user in a
    directory that user owns.

    With ``secured``, TCP clients must use TLS (a self-signed certificate, :attr:`tls`) and a
    SCRAM-SHA-256 password (``hostssl ... scram-sha-256`` is the only TCP line of pg_hba.conf);
    :attr:`dsn` (the superuser, for setting up) then goes through the Unix socket."""

    def __init__(self, secured: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="icefloe-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.dsn = f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"
        self.tls: TlsFiles | None = None
        self._as_user: list[str] = []
        if secured:
            self.dsn = f"host={self.dir} port={self.port} user=postgres dbname=postgres"
            self.tls = self_signed_cert(self.dir / "tls")
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            for path in (self.dir, *self.dir.rglob("*")):  # the server must own its key
                os.chown(path, pw.pw_uid, pw.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        auth = ["--auth-local=trust", "--auth-host=scram-sha-256"] if secured else ["-A", "trust"]
        self._run(
            _pg_bin("initdb"),
            "-D",
            str(self.data),
            *auth,
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-sync",
        )
        if secured:
            (self.data / "pg_hba.conf").write_text(
                "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\n"
            )

    def _run(self, *args: str) -> None:
        subprocess.run(
            [*self._as_user, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    def start(self) -> None:
        opts = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
            " -c max_connections=60 -c shared_buffers=16MB"
        )
        if self.tls is not None:
            opts += (
                f" -c ssl=on -c ssl_cert_file={self.tls.cert} -c ssl_key_file={self.tls.key}"
                " -c password_encryption=scram-sha-256"
            )
        self._run(
            _pg_bin("pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            opts,
            "-l",
            str(self.dir / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """``fast`` disconnects every client (rolling back open transactions); ``immediate``
        is a crash (no shutdown checkpoint, recovery on the next start)."""
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
