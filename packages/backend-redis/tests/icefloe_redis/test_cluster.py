"""The backend on a real Redis Cluster (one node owning every slot): Redis refuses a script
whose declared keys span slots (CROSSSLOT), so this proves every script's keys share the
pipeline's hash tag. (Every script touches only keys it declares; see scripts.py.)"""

from __future__ import annotations

import hashlib
import time

import pytest
import redis
from pydantic import SecretStr
from redis.exceptions import ResponseError

from icefloe.events import Event, StartCommit, WriterRef
from icefloe_redis import RedisBackend, RedisConfig
from icefloe_redis.permissions import acl_rules


@pytest.fixture
def cluster_url(private_redis, tmp_path) -> str:
    """A one-node cluster whose default user may do anything, and user ``icefloe`` (password
    ``pw``) only what :func:`acl_rules` with ``cluster=True`` grants."""
    aclfile = tmp_path / "users.acl"
    digest = hashlib.sha256(b"pw").hexdigest()
    aclfile.write_text(
        f"user default on nopass ~* &* +@all\n"
        f"user icefloe on #{digest} {acl_rules('icefloe', cluster=True)}\n"
    )
    server = private_redis(
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        str(tmp_path / "nodes.conf"),
        "--aclfile",
        str(aclfile),
    )
    admin = redis.Redis(port=server.port)
    admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 20
    while admin.cluster("info")["cluster_state"] != "ok":
        assert time.monotonic() < deadline, "the one-node cluster did not become ok"
        time.sleep(0.05)
    admin.close()
    return server.url


def test_scripts_spanning_slots_are_refused_here(cluster_url):
    """The control: this server itself enforces slots for scripts (asked without the cluster
    client, which would refuse before sending)."""
    client = redis.Redis.from_url(cluster_url)
    try:
        with pytest.raises(ResponseError, match="same slot"):
            client.execute_command(
                "EVAL", "return redis.call('MGET', KEYS[1], KEYS[2])", 2, "{a}x", "{b}y"
            )
    finally:
        client.close()


@pytest.mark.parametrize("user", [None, "icefloe"], ids=["default-user", "least-privileged"])
def test_the_whole_channel_works_on_a_cluster(cluster_url, batch_of, user):
    config = RedisConfig(
        url=cluster_url,
        cluster=True,
        key_prefix="icefloe",
        max_block_s=0.5,
        username=user,
        password=None if user is None else SecretStr("pw"),
    )
    backend = RedisBackend(config, "pipe", 1.0)
    try:
        w = backend.writer("w")
        ref = WriterRef("w", w.open())
        assert w.publish(batch_of("pipe", ref, 1, n_events=3))
        assert not w.publish(batch_of("pipe", ref, 1))
        c = backend.coordinator("c")
        lease = c.acquire(1.0)
        assert lease is not None
        assert c.renew().token == lease.token
        c.broadcast(Event("pipe", StartCommit("x")))
        assert [e.payload for e in w.poll_broadcasts(1.0)] == [StartCommit("x")]
        records = c.poll(1.0)
        assert len(records) == 4
        end = {"0": records[-1].offset + 1}
        c.store_position(end)
        assert c.prune(end) == 4
        c.release()
        assert backend.coordinator("d").acquire(0.0) is not None
        if user is None:  # decommissioning (SCAN, DEL) is not among a pipeline's grants
            assert backend.drop_state() >= 9
    finally:
        backend.close()
