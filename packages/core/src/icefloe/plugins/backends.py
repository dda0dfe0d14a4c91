"""Selecting and building the configured coordination backend through the plugin manager."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from icefloe import __version__
from icefloe.channel import (
    CONTRACT_CHANGES,
    CONTRACT_VERSION,
    OLDEST_CONTRACT_VERSION,
    UNVERSIONED_CONTRACT,
    Backend,
    upgrade_section,
)
from icefloe.config import PipelineConfig, config_error_from, env_var_for
from icefloe.errors import (
    KNOWN_BACKEND_PACKAGES,
    BackendContractError,
    ConfigError,
    UnknownBackendError,
)
from icefloe.hookspecs import BackendContext, BackendSpec
from icefloe.plugins.manager import Plugins, get_plugins


def drives(spec: BackendSpec) -> bool:
    """Whether this core drives the backend contract ``spec`` declares."""
    declared = UNVERSIONED_CONTRACT if spec.contract is None else spec.contract
    return OLDEST_CONTRACT_VERSION <= declared <= CONTRACT_VERSION


@dataclass(frozen=True)
class InstalledBackend:
    """A registered backend with the distribution that registered it and its version."""

    spec: BackendSpec
    distribution: str
    version: str | None

    @property
    def contract(self) -> int:
        """The contract version it implements (a backend that declares none: contract 1)."""
        return UNVERSIONED_CONTRACT if self.spec.contract is None else self.spec.contract

    @property
    def origin(self) -> str:
        """``distribution version``, as ``pip show`` would name it."""
        return f"{self.distribution} {self.version or '(version unknown)'}"

    def refusal(self) -> str | None:
        """Why core cannot drive this backend, in one line: what changed and what to do, and
        where to read; None when it implements a contract core drives."""
        if drives(self.spec):
            return None
        who = f"coordination backend '{self.spec.name}' of {self.origin}"
        core = f"icefloe-core {__version__} drives backend contract {CONTRACT_VERSION}"
        if OLDEST_CONTRACT_VERSION < CONTRACT_VERSION:
            core += f" (and back to {OLDEST_CONTRACT_VERSION})"
        other_release = (
            f"or install a release of {self.distribution} made for contract {CONTRACT_VERSION}"
        )
        if self.contract > CONTRACT_VERSION:
            return (
                f"{who} implements backend contract {self.contract}, newer than {core}: "
                f"upgrade icefloe-core (see CHANGELOG.md), {other_release}"
            )
        states = (
            f"declares no contract version (so contract {UNVERSIONED_CONTRACT})"
            if self.spec.contract is None
            else f"implements backend contract {self.contract}"
        )
        changes = [
            change.what + (f" (rule '{change.rule}')" if change.rule else "")
            for version in range(self.contract + 1, CONTRACT_VERSION + 1)
            for change in CONTRACT_CHANGES.get(version, ())
        ]
        return (
            f"{who} {states}, but {core}. To upgrade it: {'; '.join(changes)}. Read "
            f"{upgrade_section(self.contract + 1)}, {other_release}"
        )


def installed_backends(plugins: Plugins | None = None) -> list[InstalledBackend]:
    """Every registered backend with its origin, by name (for `icefloe backends` and
    `icefloe doctor`)."""
    plugins = plugins or get_plugins()
    origins = plugins.backend_origins()
    return [
        InstalledBackend(spec, *origins.get(name, (name, None)))
        for name, spec in sorted(plugins.backends().items())
    ]


def _spec(config: PipelineConfig, plugins: Plugins | None) -> BackendSpec:
    """The selected backend's spec; errors name an environment override that chose it, a
    backend of a contract core cannot drive and a misspelt ``[coordination.<name>]``
    section."""
    plugins = plugins or get_plugins()
    name = config.coordination.backend
    try:
        spec = plugins.backend(name)
    except UnknownBackendError as exc:
        var = env_var_for("coordination.backend")
        source = var if os.environ.get(var) == name else None
        raise UnknownBackendError(name, exc.installed, source) from None
    if not drives(spec):  # its origin is looked up only to name it in the refusal
        distribution, version = plugins.backend_origins().get(name, (name, None))
        raise BackendContractError(str(InstalledBackend(spec, distribution, version).refusal()))
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
