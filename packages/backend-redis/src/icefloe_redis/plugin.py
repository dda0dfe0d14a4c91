"""icefloe plugin entry point (hook implementations)."""

from __future__ import annotations

from collections.abc import Sequence

from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl
from icefloe_redis.backend import RedisBackend
from icefloe_redis.config import RedisConfig


def _factory(config: RedisConfig, context: BackendContext) -> RedisBackend:
    return RedisBackend(config, context.group_id, context.lease_ttl_s)


@hookimpl
def icefloe_register_backends() -> Sequence[BackendSpec]:
    """The ``redis`` backend, selected with ``coordination.backend = "redis"``."""
    return [
        BackendSpec(
            name="redis",
            config_model=RedisConfig,
            factory=_factory,
            description="Redis streams and Lua scripts (redis-py); light and fast",
            contract=2,  # docs/backend-authors.md, "Contract versions"
        )
    ]
