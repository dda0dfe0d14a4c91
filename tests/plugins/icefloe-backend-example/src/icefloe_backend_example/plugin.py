"""The entry point icefloe loads: registers the ``example`` backend."""

from __future__ import annotations

from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl
from icefloe_backend_example.channel import ExampleConfig, FileBackend


def _factory(config: ExampleConfig, context: BackendContext) -> FileBackend:
    return FileBackend(config, context)


@hookimpl
def icefloe_register_backends() -> list[BackendSpec]:
    """One backend, named ``example`` in ``coordination.backend``."""
    return [
        BackendSpec(
            name="example",
            config_model=ExampleConfig,
            factory=_factory,
            description="example third-party backend: a channel in local files",
            contract=2,  # the backend contract it implements (icefloe-core 0.2)
        )
    ]
