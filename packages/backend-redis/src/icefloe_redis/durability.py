"""Checks of the Redis server's setup that decide how much of the coordination state survives
a restart or memory pressure. Durability is Redis's own: icefloe can only tell the user."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError, ResponseError

RESTART_CONSEQUENCE = (
    "a Redis restart loses the pipeline's uncommitted coordination state (published batches "
    "not yet committed, stored positions, epochs, the lease). What is committed to Iceberg "
    "stays exactly-once: counters restart above their old values and the Iceberg snapshot "
    "summary (channel positions, writer watermarks) still prevents duplicates. Batches "
    "published but not yet committed are gone from the channel: running writers stop with "
    "RedisStateLostError, and every query of the pipeline must then be restarted with a new "
    'spark.checkpoint_location and source.starting_offsets = "table" (resuming from the '
    "source offsets committed in the tables, icefloe.source-offsets), or those records are "
    "lost. Enable AOF (appendonly yes, appendfsync always) for exactly-once across Redis "
    "restarts; see docs/backends/redis.md"
)

MIN_VERSION = (6, 2)


def _config_get(client: Any, name: str) -> str | None:
    """One CONFIG GET value; None when CONFIG is disabled or renamed (managed services)."""
    try:
        reply: dict[Any, Any] = client.config_get(name)
    except ResponseError:
        return None
    for key, value in reply.items():
        k = key.decode() if isinstance(key, bytes) else str(key)
        if k == name:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def _info(client: Any, section: str) -> dict[str, Any]:
    try:
        reply: dict[str, Any] = client.info(section)
    except ResponseError:
        return {}
    return reply


# what start-up logs instead (once per server and process): short, with the fix; doctor and
# the docs explain the rest
RESTART_CONSEQUENCE_SHORT = (
    "a Redis restart loses uncommitted batches and stops the writers; "
    "fix: appendonly yes, appendfsync always (docs/backends/redis.md)"
)


def persistence_warnings(
    client: Any, where: str, consequence: str = RESTART_CONSEQUENCE
) -> list[str]:
    """Warnings about persistence only: no AOF and no RDB snapshots, or a setup that cannot
    be verified; each ends with ``consequence``."""
    appendonly = _config_get(client, "appendonly")
    save = _config_get(client, "save")
    if appendonly is None or save is None:
        aof = _info(client, "persistence").get("aof_enabled")
        if aof is None:
            return [
                f"cannot verify persistence of Redis at {where} (CONFIG and INFO are "
                f"disabled). If it has none, {consequence}"
            ]
        if int(aof) == 1:
            return []
        return [
            f"Redis at {where} has AOF off and its RDB setting cannot be read (CONFIG is "
            f"disabled); with RDB snapshots only, or none, {consequence}"
        ]
    if appendonly == "yes":
        return []
    if save.strip():
        return [
            f"Redis at {where} persists with RDB snapshots only (save {save!r}, appendonly "
            f"no): writes after the last snapshot are lost on a crash, so {consequence}"
        ]
    return [f"Redis at {where} has no persistence (appendonly no, save ''): {consequence}"]


def server_warnings(client: Any, where: str) -> list[str]:
    """Everything `icefloe doctor` reports: persistence, fsync policy, eviction, version."""
    out = persistence_warnings(client, where)
    if _config_get(client, "appendonly") == "yes":
        fsync = _config_get(client, "appendfsync")
        if fsync is not None and fsync != "always":
            out.append(
                f"Redis at {where} fsyncs its AOF '{fsync}', not 'always': a crash of the "
                "server may lose the last writes, i.e. batches already acknowledged to their "
                "writers, without any error; set appendfsync always for exactly-once"
            )
    policy = _config_get(client, "maxmemory-policy")
    if policy is not None and policy.startswith("allkeys-"):
        out.append(
            f"Redis at {where} has maxmemory-policy {policy}: under memory pressure it may "
            "evict the pipeline's streams and counters, which loses coordination state like "
            "a restart. Use noeviction (or a volatile-* policy) for icefloe's keys"
        )
    version = str(_info(client, "server").get("redis_version", ""))
    try:
        numbers = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        numbers = ()
    if numbers and numbers < MIN_VERSION:
        out.append(
            f"Redis at {where} is version {version}; icefloe needs 6.2 or newer (XTRIM MINID)"
        )
    return out


def safely(check: Callable[[], list[str]], where: str) -> list[str]:
    """Run a check; a connection failure becomes a warning instead of an exception."""
    try:
        return check()
    except RedisError as exc:
        return [f"could not check Redis at {where}: {type(exc).__name__}: {exc}"]
