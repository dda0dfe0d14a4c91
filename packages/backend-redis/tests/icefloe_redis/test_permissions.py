"""The ACL of docs/operations.md is exact: a backend run as a user with those rules sends
every granted command and no other (counted by the server), and the docs show the rules the
code defines."""

from __future__ import annotations

import hashlib
from pathlib import Path

import redis
from pydantic import SecretStr

from icefloe.events import Event, StartCommit, WriterRef
from icefloe_redis import RedisConfig
from icefloe_redis.permissions import DIRECT_COMMANDS, SCRIPT_COMMANDS, acl_rules

from .conftest import MakeBackend, PrivateRedis, make_batch

OPERATIONS_MD = Path(__file__).resolve().parents[4] / "docs" / "operations.md"


def _commands_run(admin: redis.Redis) -> tuple[set[str], set[str]]:
    """(commands the server ran, commands it refused), from INFO commandstats: calls from
    Lua scripts count too."""
    ran, refused = set(), set()
    for name, stats in admin.info("commandstats").items():
        command = name.removeprefix("cmdstat_")
        if stats.get("calls", 0):
            ran.add(command)
        if stats.get("rejected_calls", 0):
            refused.add(command)
    return ran, refused


def test_a_backend_uses_exactly_the_granted_commands(
    tmp_path: Path, make_backend: MakeBackend
) -> None:
    digest = hashlib.sha256(b"pw").hexdigest()
    aclfile = tmp_path / "users.acl"
    aclfile.write_text(
        f"user default off\nuser admin on #{digest} ~* &* +@all\n"
        f"user icefloe on #{digest} {acl_rules('p')}\n"
    )
    server = PrivateRedis(tmp_path / "server", ("--aclfile", str(aclfile))).start()
    try:
        admin = redis.Redis(port=server.port, username="admin", password="pw")
        config = RedisConfig(
            url=server.url,
            username="icefloe",
            password=SecretStr("pw"),
            key_prefix="p",
            max_block_s=0.2,
        )
        backend = make_backend("g", cfg=config)
        writer = backend.writer("w")
        ref = WriterRef("w", writer.open())
        writer.publish(make_batch("g", ref, 0))
        coordinator = backend.coordinator("c")
        lease = coordinator.acquire(5.0)
        assert lease is not None
        assert coordinator.acquire(5.0) is not None
        coordinator.renew()
        coordinator.seek(None)
        records = coordinator.poll(1.0)
        coordinator.broadcast(Event("g", StartCommit("c-1"), writer=None))
        assert writer.poll_broadcasts(2.0)
        backend.writer("w2").open()  # notes the broadcast stream's last id (XINFO STREAM)
        writer.respond(Event("g", StartCommit("c-1"), writer=ref))
        coordinator.store_position({"0": records[-1].offset + 1})
        coordinator.stored_position()
        coordinator.prune({"0": records[-1].offset + 1})
        coordinator.channel_id()
        coordinator.end_position()
        writer.source_positions()
        backend.describe()
        backend.probe()
        backend.doctor()  # no INFO or CONFIG: it says it cannot verify, instead of failing
        coordinator.release()
        ran, refused = _commands_run(admin)
    finally:
        server.stop()
    granted = set(DIRECT_COMMANDS) | set(SCRIPT_COMMANDS)
    # HELLO (redis-py's RESP3 handshake, with AUTH) is open to every user, and the admin's
    # INFO is the check itself; the backend was refused only the optional persistence checks
    assert ran - {"hello", "auth", "info"} == granted
    assert refused == {"info", "config|get"}


def test_operations_doc_shows_the_acl_the_code_defines() -> None:
    text = OPERATIONS_MD.read_text()
    assert acl_rules() in text
    for extended in (acl_rules(doctor=True), acl_rules(cluster=True)):
        assert f"`{extended.removeprefix(acl_rules()).strip()}`" in text
