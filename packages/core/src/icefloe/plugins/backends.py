"""Selecting and building the configured coordination backend through the plugin manager."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from pydantic import BaseModel, ValidationError

from icefloe.channel import Backend
from icefloe.config import PipelineConfig, config_error_from, env_var_for
from icefloe.errors import KNOWN_BACKEND_PACKAGES, ConfigError, UnknownBackendError
from icefloe.hookspecs import BackendContext, BackendSpec
from icefloe.plugins.manager import Plugins, get_plugins


def _spec(config: PipelineConfig, plugins: Plugins | None) -> BackendSpec:
    """The selected backend's spec; errors name an environment override that chose it and a
    misspelt ``[coordination.<name>]`` section."""
    plugins = plugins or get_plugins()
    name = config.coordination.backend
    try:
        spec = plugins.backend(name)
    except UnknownBackendError as exc:
        var = env_var_for("coordination.backend")
        source = var if os.environ.get(var) == name else None
        raise UnknownBackendError(name, exc.installed, source) from None
    installed = set(plugins.backends())
    for section in config.coordination.model_extra or {}:
        if section in installed or section in KNOWN_BACKEND_PACKAGES:
            continue
        close = difflib.get_close_matches(section, sorted(installed | {name}), n=1, cutoff=0.6)
        if close:
            raise ConfigError(
                f"coordination.{section}",
                f"[coordination.{section}] is not a backend's section",
                f"did you mean [coordination.{close[0]}]? rename the section",
            )
    return spec


def _validated(spec: BackendSpec, config: PipelineConfig) -> BaseModel:
    try:
        return spec.config_model.model_validate(config.coordination.backend_options())
    except ValidationError as exc:
        raise config_error_from(exc, prefix=f"coordination.{spec.name}.") from None


def backend_config(config: PipelineConfig, plugins: Plugins | None = None) -> BaseModel:
    """The selected backend's section, validated by that backend's own model (errors name
    keys as ``coordination.<backend>.<key>``)."""
    return _validated(_spec(config, plugins), config)


def open_backend(config: PipelineConfig, plugins: Plugins | None = None) -> Backend:
    """Build the backend named by ``coordination.backend`` for this pipeline."""
    spec = _spec(config, plugins)
    context = BackendContext(
        group_id=config.name,
        lease_ttl_s=config.coordination.lease_ttl_s,
        config_dir=Path(config.config_dir) if config.config_dir else None,
    )
    return spec.factory(_validated(spec, config), context)
