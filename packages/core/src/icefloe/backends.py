"""Selecting and building the configured coordination backend through the plugin manager."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from icefloe.channel import Backend
from icefloe.config import PipelineConfig, config_error_from
from icefloe.hookspecs import BackendContext
from icefloe.plugins import Plugins, get_plugins


def backend_config(config: PipelineConfig, plugins: Plugins | None = None) -> BaseModel:
    """The selected backend's section, validated by that backend's own model."""
    spec = (plugins or get_plugins()).backend(config.coordination.backend)
    options: dict[str, Any] = config.coordination.backend_options()
    try:
        return spec.config_model.model_validate(options)
    except ValidationError as exc:
        raise config_error_from(exc, prefix=f"coordination.{spec.name}.") from None


def open_backend(config: PipelineConfig, plugins: Plugins | None = None) -> Backend:
    """Build the backend named by ``coordination.backend`` for this pipeline."""
    plugins = plugins or get_plugins()
    spec = plugins.backend(config.coordination.backend)
    context = BackendContext(group_id=config.name, lease_ttl_s=config.coordination.lease_ttl_s)
    return spec.factory(backend_config(config, plugins), context)
