"""Many writers in one process (issue 15's fan-out): a cycle completes with every row exactly
once (pyiceberg scan), and idle writers send (almost) no commands: one shared blocking reader
watches the broadcasts for all of them (counted with the server's own INFO commandstats)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import redis

from icefloe.coordination.writer import WriterClient
from icefloe.testing.fixtures import make_sqlite_catalog
from icefloe.testing.harness import fan_out_cycle
from icefloe_redis import RedisBackend, RedisConfig
from icefloe_redis.broadcasts import FALLBACK_READS

from .conftest import MakeBackend, PrivateRedis

WRITERS = 256


def test_writers_of_one_process_complete_a_cycle_exactly(
    make_backend: MakeBackend, group_id: str, tmp_path: Path
) -> None:
    backend = make_backend(lease_ttl_s=30.0)
    seen = fan_out_cycle(backend, make_sqlite_catalog(tmp_path), group_id, WRITERS)
    assert seen.result.complete, "some writer's answer never reached the coordinator"
    assert not seen.result.failed
    assert seen.answered == WRITERS


def _xread_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


def test_idle_writers_share_one_blocking_read(
    private_redis: Callable[..., PrivateRedis], group_id: str
) -> None:
    server = private_redis()  # a server of its own: every XREAD counted is ours
    config = RedisConfig(url=server.url, key_prefix="fan", max_block_s=0.5)
    backend = RedisBackend(config, group_id, 5.0)
    client = redis.Redis.from_url(server.url)
    writers = [WriterClient(backend.writer(f"w{i}"), group_id, f"w{i}") for i in range(64)]
    try:
        for w in writers:
            w.start()
        time.sleep(1.0)  # let every responder settle into its idle wait
        before, started = _xread_calls(client), time.monotonic()
        time.sleep(3.0)
        calls, idle_s = _xread_calls(client) - before, time.monotonic() - started
        # by design: the shared reader's blocking XREADs (one per max_block_s) plus each
        # writer's fallback read (one per FALLBACK_READS x max_block_s), one round of slack
        # each; one XREAD per writer per 0.1 s poll (what it was) is far above this
        reader = idle_s / config.max_block_s + 2
        fallback = idle_s / (FALLBACK_READS * config.max_block_s) + 1
        bound = reader + len(writers) * fallback
        assert calls <= bound, f"{calls} XREADs in {idle_s:.1f}s by {len(writers)} idle writers"
    finally:
        for w in writers:
            w.close()
        backend.close()
        client.close()
