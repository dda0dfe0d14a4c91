"""icefloe plugin entry point (hook implementations)."""

from __future__ import annotations

from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl
from icefloe_kafka.backend import KafkaBackend
from icefloe_kafka.config import KafkaBackendConfig


def create_backend(config: KafkaBackendConfig, context: BackendContext) -> KafkaBackend:
    """Factory called by ``icefloe.plugins.backends.open_backend`` with the validated section.
    Connects lazily: the topics are checked or created when the first channel is used."""
    return KafkaBackend(config, context.group_id, context.lease_ttl_s)


@hookimpl
def icefloe_register_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="kafka",
            config_model=KafkaBackendConfig,
            factory=create_backend,
            description="Kafka control topic: transactional writers, lease in a compacted "
            "state topic (the default)",
            contract=2,  # docs/backend-authors.md, "Contract versions"
        )
    ]
