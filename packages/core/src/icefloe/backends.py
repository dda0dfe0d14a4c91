"""Selecting and building the configured coordination backend through the plugin manager."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError

from icefloe.channel import Backend
from icefloe.config import PipelineConfig, config_error_from
from icefloe.hookspecs import BackendContext, BackendSpec
from icefloe.plugins import Plugins, get_plugins


def _validated(spec: BackendSpec, config: PipelineConfig) -> BaseModel:
    try:
        return spec.config_model.model_validate(config.coordination.backend_options())
    except ValidationError as exc:
        raise config_error_from(exc, prefix=f"coordination.{spec.name}.") from None


def backend_config(config: PipelineConfig, plugins: Plugins | None = None) -> BaseModel:
    """The selected backend's section, validated by that backend's own model (errors name
    keys as ``coordination.<backend>.<key>``)."""
    spec = (plugins or get_plugins()).backend(config.coordination.backend)
    return _validated(spec, config)


def open_backend(config: PipelineConfig, plugins: Plugins | None = None) -> Backend:
    """Build the backend named by ``coordination.backend`` for this pipeline."""
    spec = (plugins or get_plugins()).backend(config.coordination.backend)
    context = BackendContext(
        group_id=config.name,
        lease_ttl_s=config.coordination.lease_ttl_s,
        config_dir=Path(config.config_dir) if config.config_dir else None,
    )
    return spec.factory(_validated(spec, config), context)
