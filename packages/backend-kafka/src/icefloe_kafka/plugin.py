"""icefloe plugin entry point (hook implementations)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl
from icefloe_kafka.config import KafkaBackendConfig

if TYPE_CHECKING:
    from icefloe_kafka.backend import KafkaBackend


def create_backend(config: KafkaBackendConfig, context: BackendContext) -> KafkaBackend:
    """Factory called by ``icefloe.plugins.backends.open_backend`` with the validated section.
    Connects lazily: the topics are checked or created when the first channel is used. The
    backend module is imported here, not by every CLI command that loads this plugin."""
    from icefloe_kafka.backend import KafkaBackend

    servers = context.source_bootstrap_servers
    return KafkaBackend(config, context.group_id, context.lease_ttl_s, source_servers=servers)


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


@hookimpl
def icefloe_cli(app: Any) -> None:
    """Add ``icefloe broker``, the bundled Kafka-protocol broker for trying icefloe."""
    from icefloe_kafka.broker_command import register

    register(app)
