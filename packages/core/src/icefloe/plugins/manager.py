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
from typing import TYPE_CHECKING, Any

import pluggy

from icefloe import hookspecs
from icefloe.config import BACKEND_NAME_RE
from icefloe.errors import (
    DuplicateBackendError,
    PluginError,
    UnknownBackendError,
    UnknownCodecError,
)
from icefloe.hookspecs import PROJECT, BackendSpec, Check, CodecSpec, TableCommitted

if TYPE_CHECKING:
    from icefloe.config import PipelineConfig

log = logging.getLogger("icefloe.plugins")

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

    def _call(self, hook: Any, kind: type[Any]) -> list[Any]:
        """The hook's specs, called through pluggy (``hook()``), so hook wrappers and
        ``tryfirst``/``trylast`` of third-party plugins apply. Only when something is wrong
        are the implementations called one by one, to name the culprit's distribution."""
        try:
            merged = [spec for result in hook() for spec in (result or ())]
        except Exception:
            self._collect_each(hook, kind)  # raises, naming the implementation
            raise
        if any(not isinstance(spec, kind) for spec in merged):
            self._collect_each(hook, kind)
            raise PluginError(
                f"a hook wrapper of {hook.name} returned something else than {kind.__name__}"
            )
        return merged

    def _collect_each(self, hook: Any, kind: type[Any]) -> list[tuple[Any, str]]:
        """Call each implementation separately to trace every spec to its distribution."""
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
        hook = self.pm.hook.icefloe_register_backends
        specs: list[BackendSpec] = self._call(hook, BackendSpec)
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names) or not all(re.match(BACKEND_NAME_RE, n) for n in names):
            self._check_backends(self._collect_each(hook, BackendSpec))
            seen: set[str] = set()
            for name in names:  # the implementations are fine: a wrapper added the problem
                if name in seen or not re.match(BACKEND_NAME_RE, name):
                    raise DuplicateBackendError(name, "a hook wrapper", "a hook wrapper")
                seen.add(name)
        return {spec.name: spec for spec in specs}

    @staticmethod
    def _check_backends(found_specs: list[tuple[BackendSpec, str]]) -> None:
        """Raise the error naming the distributions of a bad name or a name clash."""
        found: dict[str, str] = {}
        for spec, dist in found_specs:
            if not re.match(BACKEND_NAME_RE, spec.name):
                raise PluginError(
                    f"'{dist}' registers a backend named {spec.name!r}; a backend name is "
                    "letters, digits, '-' and '_' (it names the [coordination.<name>] table)"
                )
            if spec.name in found:
                raise DuplicateBackendError(spec.name, found[spec.name], dist)
            found[spec.name] = dist

    def backend_origins(self) -> dict[str, tuple[str, str | None]]:
        """Each backend's distribution and that distribution's installed version (None for a
        plugin registered by code), for messages that say what to upgrade. Calls each
        implementation on its own, so ask only when a message needs it."""
        out: dict[str, tuple[str, str | None]] = {}
        hook = self.pm.hook.icefloe_register_backends
        for spec, dist in self._collect_each(hook, BackendSpec):
            try:
                version: str | None = importlib.metadata.version(dist)
            except (importlib.metadata.PackageNotFoundError, ValueError):
                version = None
            out.setdefault(spec.name, (dist, version))
        return out

    def backend(self, name: str) -> BackendSpec:
        """The backend called ``name``, or UnknownBackendError naming what is installed."""
        specs = self.backends()
        if name not in specs:
            raise UnknownBackendError(name, list(specs))
        return specs[name]

    def codecs(self) -> dict[str, CodecSpec]:
        """All registered record codecs by name (a later plugin may not shadow an earlier)."""
        found: dict[str, CodecSpec] = {}
        for spec in self._call(self.pm.hook.icefloe_register_codecs, CodecSpec):
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
        happened), and one failing plugin does not keep the others from being told.

        Each implementation is called through pluggy (a subset caller without the other
        implementations), in pluggy's order (``tryfirst``/``trylast``), with every hook
        wrapper around it: wrappers thus run once per notified plugin.
        """
        name = "icefloe_after_table_commit"
        impls = self.pm.hook.icefloe_after_table_commit.get_hookimpls()
        wrappers = {id(i.plugin) for i in impls if i.hookwrapper or i.wrapper}
        for impl in reversed(impls):  # pluggy calls the last registered first
            if impl.hookwrapper or impl.wrapper:
                continue
            others = [
                i.plugin
                for i in impls
                if i.plugin is not impl.plugin and id(i.plugin) not in wrappers
            ]
            try:
                self.pm.subset_hook_caller(name, remove_plugins=others)(event=event)
            except Exception:
                log.exception("plugin %s failed in %s", impl.plugin_name, name)

    def source_lag(self, config: PipelineConfig) -> dict[str, int | None]:
        """Per-table source lag from the plugins that know the source (empty: unknown)."""
        out: dict[str, int | None] = {}
        try:
            for result in self.pm.hook.icefloe_source_lag(config=config):
                out.update(result or {})
        except Exception:
            log.warning("source lag unavailable", exc_info=True)
        return out

    def doctor_checks(self, config: PipelineConfig) -> list[Check]:
        """The plugins' `icefloe doctor` checks (a plugin that fails is a failed check)."""
        try:
            results = self.pm.hook.icefloe_doctor(config=config)
        except Exception as exc:
            return [Check("plugin checks", "fail", f"{type(exc).__name__}: {exc}")]
        return [check for result in results for check in (result or ())]

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
        ours = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        if not ours:
            continue  # its METADATA unread: parsing every installed one cost ~0.1 s a command
        dist_name = dist.metadata["Name"]
        for ep in ours:
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
