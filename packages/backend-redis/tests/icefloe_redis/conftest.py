"""Fixtures: the shared Redis at 127.0.0.1:6379 under a key prefix of this session (deleted
afterwards), and private redis-server processes for tests that restart or reconfigure one."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from pydantic import SecretStr
from redis.exceptions import RedisError

from icefloe.channel import WriterBatch
from icefloe.events import (
    DataComplete,
    DataFileMeta,
    DataWritten,
    Event,
    SourcePosition,
    WriterRef,
)
from icefloe.testing.tls import TlsFiles, self_signed_cert
from icefloe_redis import RedisBackend, RedisConfig
from icefloe_redis.permissions import acl_rules

REDIS_URL = os.environ.get("ICEFLOE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The shared server; the run fails (never skips) when it is missing."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except RedisError as exc:
        pytest.fail(
            f"these tests need Redis at {REDIS_URL} ({exc}); start it with "
            "`redis-server --daemonize yes --port 6379 --save '' --appendonly no`"
        )
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture(scope="session")
def key_prefix(redis_url: str) -> Iterator[str]:
    """A prefix no other session uses; every key under it is deleted at the end."""
    prefix = f"icefloe-test-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)
    finally:
        client.close()


@pytest.fixture
def group_id() -> str:
    return f"pipe-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def config(redis_url: str, key_prefix: str) -> RedisConfig:
    return RedisConfig(url=redis_url, key_prefix=key_prefix, max_block_s=0.5)


MakeBackend = Callable[..., RedisBackend]


@pytest.fixture
def make_backend(config: RedisConfig, group_id: str) -> Iterator[MakeBackend]:
    """Backends on the shared server (default: this test's pipeline, 2 s leases)."""
    made: list[RedisBackend] = []

    def make(
        group: str | None = None, lease_ttl_s: float = 2.0, cfg: RedisConfig | None = None
    ) -> RedisBackend:
        backend = RedisBackend(cfg or config, group or group_id, lease_ttl_s)
        made.append(backend)
        return backend

    yield make
    for b in made:
        b.close()


def data_file(path: str, records: int = 10) -> DataFileMeta:
    return DataFileMeta(path=path, record_count=records, file_size_in_bytes=100 + records)


def make_batch(
    group: str,
    ref: WriterRef,
    seq: int,
    n_events: int = 1,
    offset: int | None = None,
    table: str = "db.t",
) -> WriterBatch:
    """A writer batch of ``n_events`` DataWritten plus a DataComplete at source ``offset``."""
    positions = (SourcePosition("src", 0, seq + 1 if offset is None else offset, 1000 + seq),)
    events = [
        Event(
            group,
            DataWritten(table, (data_file(f"file:///w/{ref.writer_id}-{seq}-{i}.parquet"),)),
            writer=ref,
            batch_seq=seq,
        )
        for i in range(n_events)
    ]
    events.append(Event(group, DataComplete(positions), writer=ref, batch_seq=seq))
    return WriterBatch(ref, seq, tuple(events), positions)


@pytest.fixture
def batch_of() -> Callable[..., WriterBatch]:
    return make_batch


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; redis-server refuses ports
    above 55535 in cluster mode, so the OS's ephemeral range will not do."""
    rng = random.Random()
    while True:
        port = rng.randrange(20_000, 45_000)
        if _bindable(port) and _bindable(port + 10_000):
            return port


class PrivateRedis:
    """A redis-server of our own on a free port (no persistence unless asked), for tests
    that restart it or need a particular configuration; with ``tls`` it takes only TLS
    connections, on that port."""

    def __init__(self, workdir: Path, args: tuple[str, ...], tls: TlsFiles | None = None) -> None:
        self.workdir = workdir
        self.port = _free_port()
        if tls is not None:
            args = (
                *("--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"),
                *("--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key)),
                *("--tls-ca-cert-file", str(tls.ca), *args),
            )
        self.args = args
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "redis" if self.tls is None else "rediss"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--daemonize", "no", "--dir", str(self.workdir)]
        defaults = {"--save": "", "--appendonly": "no"}
        for key, value in defaults.items():
            if key not in self.args:
                cmd += [key, value]
        cmd += list(self.args)
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited: {(self.workdir / 'redis.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("private redis-server did not start within 20 s")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Callable[..., PrivateRedis]]:
    """Start private servers with extra redis-server arguments; all stop at teardown."""
    servers: list[PrivateRedis] = []

    def start(*args: str) -> PrivateRedis:
        server = PrivateRedis(tmp_path / f"redis-{len(servers)}", args)
        servers.append(server)
        return server.start()

    yield start
    for s in servers:
        s.stop()


#: the user, password and key prefix of the secured server's only enabled user
ACL_USER = "icefloe"
ACL_PASSWORD = "acl-pw-Sekrit-6379"
ACL_PREFIX = "icefloe-acl"


@pytest.fixture(scope="session")
def secured_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisConfig]:
    """A private redis-server that takes only TLS connections (a self-signed certificate) and
    only the ACL user ``icefloe`` with exactly :func:`acl_rules` (the default user is off);
    yields the backend settings that reach it (verifying the certificate)."""
    workdir = tmp_path_factory.mktemp("secured-redis")
    tls = self_signed_cert(workdir / "tls")
    digest = hashlib.sha256(ACL_PASSWORD.encode()).hexdigest()  # the file holds no password
    aclfile = workdir / "users.acl"
    aclfile.write_text(f"user default off\nuser {ACL_USER} on #{digest} {acl_rules(ACL_PREFIX)}\n")
    server = PrivateRedis(workdir / "server", ("--aclfile", str(aclfile)), tls=tls).start()
    yield RedisConfig(
        url=server.url,
        username=ACL_USER,
        password=SecretStr(ACL_PASSWORD),
        key_prefix=ACL_PREFIX,
        ssl_ca_certs=str(tls.ca),
        max_block_s=0.5,
    )
    server.stop()
