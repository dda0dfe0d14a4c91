"""icefloe plugin entry point (hook implementations)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl
from icefloe_redis.config import RedisConfig

if TYPE_CHECKING:
    from icefloe_redis.backend import RedisBackend


def _factory(config: RedisConfig, context: BackendContext) -> RedisBackend:
    """Imports redis-py only here: every CLI command loads this plugin, few open Redis."""
    from icefloe_redis.backend import RedisBackend

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
