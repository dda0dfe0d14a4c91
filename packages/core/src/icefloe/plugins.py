"""The ``icefloe`` plugin manager and a typed facade over its hooks.

Nothing is loaded at import time: :func:`get_plugins` loads the ``icefloe`` entry points on
first use, unless ``ICEFLOE_DISABLE_PLUGIN_AUTOLOAD`` is set to a true value (``1``, ``true``,
``yes``); then only plugins registered by code are seen, which is what isolated tests want.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import threading
from collections.abc import Iterable
from typing import Any

import pluggy

from icefloe import hookspecs
from icefloe.config import BACKEND_NAME_RE
from icefloe.errors import (
    DuplicateBackendError,
    PluginError,
    UnknownBackendError,
    UnknownCodecError,
)
from icefloe.hookspecs import PROJECT, BackendSpec, CodecSpec, TableCommitted

log = logging.getLogger(__name__)

DISABLE_AUTOLOAD_ENV = "ICEFLOE_DISABLE_PLUGIN_AUTOLOAD"
ENTRY_POINT_GROUP = PROJECT


class Plugins:
    """Typed access to the hooks, with the errors users need when a plugin is missing or
    registered twice."""

    def __init__(self, pm: pluggy.PluginManager, distributions: dict[int, str] | None = None):
        self.pm = pm
        self.distributions = dict(distributions or {})

    def _distribution_of(self, plugin: object) -> str:
        return self.distributions.get(id(plugin)) or self.pm.get_name(plugin) or repr(plugin)

    def _collect(self, hook: Any, kind: type[Any]) -> list[tuple[Any, str]]:
        """Call each implementation separately so every spec can be traced to its distribution
        (``pm.hook`` would merge the results and lose who returned what)."""
        out: list[tuple[Any, str]] = []
        for impl in hook.get_hookimpls():
            dist = self._distribution_of(impl.plugin)
            try:
                specs = list(impl.function() or ())
            except Exception as exc:
                raise PluginError(
                    f"icefloe plugin '{impl.plugin_name}' of '{dist}' failed in {hook.name} "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            for spec in specs:
                if not isinstance(spec, kind):
                    raise PluginError(
                        f"icefloe plugin '{impl.plugin_name}' of '{dist}' returned "
                        f"{type(spec).__name__} from {hook.name}; expected {kind.__name__}"
                    )
                out.append((spec, dist))
        return out

    def backends(self) -> dict[str, BackendSpec]:
        """All registered backends by name. Raises DuplicateBackendError on a name clash."""
        found: dict[str, tuple[BackendSpec, str]] = {}
        for spec, dist in self._collect(self.pm.hook.icefloe_register_backends, BackendSpec):
            if not re.match(BACKEND_NAME_RE, spec.name):
                raise PluginError(
                    f"'{dist}' registers a backend named {spec.name!r}; a backend name is "
                    "letters, digits, '-' and '_' (it names the [coordination.<name>] table)"
                )
            if spec.name in found:
                raise DuplicateBackendError(spec.name, found[spec.name][1], dist)
            found[spec.name] = (spec, dist)
        return {name: spec for name, (spec, _) in found.items()}

    def backend(self, name: str) -> BackendSpec:
        """The backend called ``name``, or UnknownBackendError naming what is installed."""
        specs = self.backends()
        if name not in specs:
            raise UnknownBackendError(name, list(specs))
        return specs[name]

    def codecs(self) -> dict[str, CodecSpec]:
        """All registered record codecs by name (a later plugin may not shadow an earlier)."""
        found: dict[str, CodecSpec] = {}
        for spec, _dist in self._collect(self.pm.hook.icefloe_register_codecs, CodecSpec):
            found.setdefault(spec.name, spec)
        return found

    def codec(self, name: str) -> CodecSpec:
        """The codec for record format ``name``, or UnknownCodecError."""
        specs = self.codecs()
        if name not in specs:
            raise UnknownCodecError(name, list(specs))
        return specs[name]

    def after_table_commit(self, event: TableCommitted) -> None:
        """Notify plugins; their failures are logged, never raised (the commit already
        happened)."""
        for impl in self.pm.hook.icefloe_after_table_commit.get_hookimpls():
            try:
                # pluggy lets an implementation accept fewer arguments than the spec
                impl.function(*[event for _ in impl.argnames])
            except Exception:
                log.exception("plugin %s failed in icefloe_after_table_commit", impl.plugin_name)

    def extend_cli(self, app: Any) -> None:
        """Let plugins add CLI commands."""
        self.pm.hook.icefloe_cli(app=app)

    def check_pending(self) -> None:
        """Fail if a plugin implements a hook icefloe does not define (a typo or version skew)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            dist = self._distribution_of(exc.plugin)
            raise PluginError(
                f"icefloe plugin of '{dist}': {exc}; check the hook name's spelling against "
                "icefloe.hookspecs or upgrade icefloe-core"
            ) from exc


def load_entry_points(
    pm: pluggy.PluginManager,
    distributions: Iterable[importlib.metadata.Distribution] | None = None,
) -> dict[int, str]:
    """Register every ``icefloe`` entry point of ``distributions`` (default: all installed);
    return plugin id -> distribution name.

    Not pluggy's ``load_setuptools_entrypoints``: that one registers by entry-point name, so a
    second distribution using the same name is skipped silently (and a duplicate backend
    never seen), and one broken plugin aborts with a bare traceback.
    """
    dists: dict[int, str] = {}
    if distributions is None:
        distributions = importlib.metadata.distributions()
    for dist in distributions:
        dist_name = dist.metadata["Name"]
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP:
                continue
            name = f"{dist_name}:{ep.name}"
            if pm.get_plugin(name) is not None or pm.is_blocked(name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"icefloe plugin '{ep.name}' of distribution '{dist_name}' failed to load "
                    f"({type(exc).__name__}: {exc}); reinstall or uninstall '{dist_name}'"
                ) from exc
            if pm.is_registered(plugin):
                continue  # two entry points naming one module: register it once
            try:
                pm.register(plugin, name=name)
            except (ValueError, pluggy.PluginValidationError) as exc:
                raise PluginError(
                    f"icefloe plugin '{ep.name}' of distribution '{dist_name}' could not be "
                    f"registered ({exc}); reinstall or uninstall '{dist_name}'"
                ) from exc
            dists[id(plugin)] = dist_name
    return dists


def autoload_disabled() -> bool:
    """Whether ``ICEFLOE_DISABLE_PLUGIN_AUTOLOAD`` asks not to load entry points."""
    value = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def new_plugins(autoload: bool | None = None) -> Plugins:
    """A fresh facade over a new manager with the hookspecs added and, unless disabled by
    ``ICEFLOE_DISABLE_PLUGIN_AUTOLOAD``, the entry points loaded."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs.IcefloeHookSpecs)
    if autoload is None:
        autoload = not autoload_disabled()
    dists = load_entry_points(pm) if autoload else {}
    return Plugins(pm, dists)


_lock = threading.Lock()
_default: Plugins | None = None


def get_plugins() -> Plugins:
    """The process-wide plugin facade, created (and entry points loaded) on first call."""
    global _default
    with _lock:
        if _default is None:
            _default = new_plugins()
        return _default


def reset_plugins(plugins: Plugins | None = None) -> None:
    """Replace the process-wide facade (tests; embedding applications)."""
    global _default
    with _lock:
        _default = plugins
