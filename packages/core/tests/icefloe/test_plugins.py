"""The ``icefloe`` plugin system: names, entry-point loading, errors users meet, notifications."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pluggy
import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from icefloe import hookspecs
from icefloe.channel import CONTRACT_VERSION, Backend, CoordinatorChannel, WriterBatch
from icefloe.cli.main import app as cli_app
from icefloe.config import config_from_dict
from icefloe.errors import (
    BackendContractError,
    DuplicateBackendError,
    IcefloeError,
    MissingBackendMethodError,
    PluginError,
    UnknownBackendError,
    UnknownCodecError,
)
from icefloe.events import DataComplete, Event, SourcePosition, StartCommit, WriterRef
from icefloe.hookspecs import BackendContext, BackendSpec, TableCommitted, hookimpl
from icefloe.plugins import manager as plugins_module
from icefloe.plugins.backends import backend_config, open_backend
from icefloe.plugins.manager import Plugins, load_entry_points, new_plugins
from icefloe.testing.memory import MemoryBackend, MemoryCoordinatorChannel, MemoryServer


class NoOptions(BaseModel):
    """Config model of the test backends."""

    greeting: str = "hello"


def _spec(name: str, factory: Any = None) -> BackendSpec:
    return BackendSpec(
        name,
        NoOptions,
        factory or (lambda c, ctx: None),  # type: ignore[arg-type]
        f"{name} backend",
        contract=CONTRACT_VERSION,
    )


class TwoBackends:
    @hookimpl
    def icefloe_register_backends(self) -> list[BackendSpec]:
        return [_spec("alpha"), _spec("beta")]


def _plugins(*objects: object) -> Plugins:
    plugins = new_plugins(autoload=False)
    for obj in objects:
        plugins.pm.register(obj)
    return plugins


def _config(backend: str, **section: Any) -> Any:
    coordination: dict[str, Any] = {"backend": backend, "lease_ttl_s": 3.5}
    if section:
        coordination[backend] = section
    return config_from_dict(
        {
            "name": "grp",
            "source": {"topics": ["t"]},
            "tables": [{"name": "db.t"}],
            "coordination": coordination,
        }
    )


@pytest.fixture
def dist_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path where tests create installed-looking distributions."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)
    yield root
    for name in set(sys.modules) - before:
        if name.startswith("fakeplugin_"):
            del sys.modules[name]


def make_dist(root: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Write a distribution as an installer would: a ``.dist-info`` with METADATA and
    entry_points.txt, and its top-level modules."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[icefloe]\n{lines}\n[other.group]\nx = os\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


def _module_name() -> str:
    return f"fakeplugin_{uuid.uuid4().hex[:10]}"


BACKEND_MODULE = """
from pydantic import BaseModel
from icefloe.hookspecs import BackendSpec, hookimpl

class Options(BaseModel):
    pass

@hookimpl
def icefloe_register_backends():
    return [BackendSpec({name!r}, Options, lambda c, ctx: None, "from a distribution", contract=2)]
"""


def _load(root: Path) -> Plugins:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs.IcefloeHookSpecs)
    dists = load_entry_points(pm, importlib.metadata.distributions(path=[str(root)]))
    return Plugins(pm, dists)


# --------------------------------------------------------------------------- names


def test_marker_manager_and_entry_point_group_are_all_icefloe() -> None:
    assert hookspecs.PROJECT == "icefloe"
    assert hookspecs.hookspec.project_name == "icefloe"
    assert hookspecs.hookimpl.project_name == "icefloe"
    assert plugins_module.ENTRY_POINT_GROUP == "icefloe"
    assert new_plugins(autoload=False).pm.project_name == "icefloe"
    core = importlib.metadata.distribution("icefloe-core")
    assert "codecs" in {ep.name for ep in core.entry_points if ep.group == "icefloe"}


def test_hookspecs_are_documented() -> None:
    for name in dir(hookspecs.IcefloeHookSpecs):
        if name.startswith("icefloe_"):
            assert getattr(hookspecs.IcefloeHookSpecs, name).__doc__, name


# --------------------------------------------------------------------------- loading


def test_entry_points_of_distributions_are_registered_with_their_distribution(
    dist_root: Path,
) -> None:
    mod = _module_name()
    make_dist(
        dist_root,
        "icefloe-backend-gamma",
        {"gamma": mod},
        {mod: BACKEND_MODULE.format(name="gamma")},
    )
    plugins = _load(dist_root)
    assert plugins.pm.get_plugin("icefloe-backend-gamma:gamma") is not None
    assert list(plugins.backends()) == ["gamma"]
    assert plugins.backend("gamma").description == "from a distribution"


def test_duplicate_backend_names_name_both_distributions(dist_root: Path) -> None:
    a, b = _module_name(), _module_name()
    make_dist(dist_root, "icefloe-backend-one", {"x": a}, {a: BACKEND_MODULE.format(name="dup")})
    make_dist(dist_root, "acme-icefloe-two", {"x": b}, {b: BACKEND_MODULE.format(name="dup")})
    plugins = _load(dist_root)
    with pytest.raises(DuplicateBackendError) as info:
        plugins.backends()
    assert info.value.name == "dup"
    assert set(info.value.distributions) == {"icefloe-backend-one", "acme-icefloe-two"}
    assert "icefloe-backend-one" in str(info.value)
    assert "acme-icefloe-two" in str(info.value)


class _NoPlugins(importlib.metadata.Distribution):
    """An installed distribution without icefloe entry points whose METADATA must stay
    unread: parsing that of every installed one cost every command ~0.1 s (issue 24, 8)."""

    def read_text(self, filename: str) -> str | None:
        assert filename != "METADATA", "read the METADATA of a distribution without plugins"
        return "[console_scripts]\nx = os\n" if filename == "entry_points.txt" else None

    def locate_file(self, path: str | os.PathLike[str]) -> Path:
        return Path(path)


def test_only_distributions_with_icefloe_entry_points_have_their_metadata_read(
    dist_root: Path,
) -> None:
    mod = _module_name()
    make_dist(
        dist_root, "icefloe-backend-delta", {"d": mod}, {mod: BACKEND_MODULE.format(name="d")}
    )
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs.IcefloeHookSpecs)
    found = importlib.metadata.distributions(path=[str(dist_root)])
    dists = load_entry_points(pm, [_NoPlugins(), *found])
    assert list(dists.values()) == ["icefloe-backend-delta"]


def test_plugin_that_fails_to_import_names_distribution_and_entry_point(
    dist_root: Path,
) -> None:
    make_dist(dist_root, "icefloe-backend-broken", {"brk": "fakeplugin_not_there_at_all"}, {})
    with pytest.raises(PluginError) as info:
        _load(dist_root)
    text = str(info.value)
    assert "'brk'" in text
    assert "'icefloe-backend-broken'" in text
    assert "ModuleNotFoundError" in text


def test_plugin_that_raises_on_import_names_distribution_and_entry_point(
    dist_root: Path,
) -> None:
    mod = _module_name()
    make_dist(dist_root, "icefloe-backend-bad", {"bad": mod}, {mod: "1 / 0\n"})
    with pytest.raises(PluginError, match=r"'bad' of distribution 'icefloe-backend-bad'.*Zero"):
        _load(dist_root)


def test_plugin_with_a_hook_of_the_wrong_signature_is_refused(dist_root: Path) -> None:
    mod = _module_name()
    source = """
    from icefloe.hookspecs import hookimpl

    @hookimpl
    def icefloe_after_table_commit(event, extra):
        pass
    """
    make_dist(dist_root, "icefloe-notify-odd", {"odd": mod}, {mod: source})
    with pytest.raises(PluginError, match="icefloe-notify-odd"):
        _load(dist_root)


def test_check_pending_catches_a_misspelt_hook(dist_root: Path) -> None:
    mod = _module_name()
    source = """
    from icefloe.hookspecs import hookimpl

    @hookimpl
    def icefloe_register_backend():
        return []
    """
    make_dist(dist_root, "icefloe-typo", {"typo": mod}, {mod: source})
    plugins = _load(dist_root)
    with pytest.raises(PluginError) as info:
        plugins.check_pending()
    assert "icefloe_register_backend" in str(info.value)
    assert "icefloe-typo" in str(info.value)
    _plugins(TwoBackends()).check_pending()  # a correct plugin passes


def test_autoload_loads_installed_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugins_module.DISABLE_AUTOLOAD_ENV, raising=False)
    names = [name for name, _ in new_plugins().pm.list_name_plugin()]
    assert "icefloe-core:codecs" in names


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_disable_autoload_env_is_honoured(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins_module.DISABLE_AUTOLOAD_ENV, value)
    assert plugins_module.autoload_disabled()
    assert new_plugins().pm.list_name_plugin() == []


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_autoload_stays_on_for_false_values(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins_module.DISABLE_AUTOLOAD_ENV, value)
    assert not plugins_module.autoload_disabled()


def test_importing_icefloe_loads_no_entry_point() -> None:
    script = """
    import importlib.metadata as md, json, sys
    loaded = []
    original = md.EntryPoint.load
    def load(self):
        loaded.append(self.name) if self.group == "icefloe" else None
        return original(self)
    md.EntryPoint.load = load
    import icefloe, icefloe.cli.main, icefloe.plugins.manager, icefloe.plugins.backends
    import icefloe.config, icefloe.events, icefloe.channel, icefloe.hookspecs
    at_import = list(loaded)
    icefloe.plugins.manager.get_plugins()
    print(json.dumps({"at_import": at_import, "on_first_use": loaded}))
    """
    env = {k: v for k, v in os.environ.items() if k != plugins_module.DISABLE_AUTOLOAD_ENV}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["at_import"] == []
    assert "codecs" in result["on_first_use"]  # the same script does load on first use


def test_process_wide_plugins_are_created_once_and_replaceable() -> None:
    mine = _plugins(TwoBackends())
    plugins_module.reset_plugins(mine)
    try:
        assert plugins_module.get_plugins() is mine
        assert plugins_module.get_plugins() is mine
    finally:
        plugins_module.reset_plugins(None)
    assert plugins_module._default is None


# --------------------------------------------------------------------------- backends


def test_backends_by_name() -> None:
    plugins = _plugins(TwoBackends())
    assert sorted(plugins.backends()) == ["alpha", "beta"]
    assert plugins.backend("beta").name == "beta"


def test_unknown_backend_names_it_lists_installed_and_the_package() -> None:
    plugins = _plugins(TwoBackends())
    with pytest.raises(UnknownBackendError) as info:
        plugins.backend("postgress")
    err = info.value
    assert err.name == "postgress"
    assert sorted(err.installed) == ["alpha", "beta"]
    text = str(err)
    assert "'postgress' is not installed" in text
    assert "installed: alpha, beta" in text
    # never an invented package name (typosquatting); the known one it resembles instead
    assert "icefloe-backend-postgress" not in text
    assert "did you mean 'postgres'?" in text
    assert "pip install icefloe-backend-postgres`" in text


def test_unknown_backend_with_none_installed() -> None:
    with pytest.raises(UnknownBackendError, match=r"installed: none"):
        _plugins().backend("redis")


def test_duplicate_backend_in_code_registered_plugins() -> None:
    class Again:
        @hookimpl
        def icefloe_register_backends(self) -> list[BackendSpec]:
            return [_spec("alpha")]

    plugins = _plugins(TwoBackends())
    plugins.pm.register(Again(), name="again-plugin")
    with pytest.raises(DuplicateBackendError, match="again-plugin"):
        plugins.backends()


def test_hook_returning_the_wrong_type_is_a_plugin_error() -> None:
    class Wrong:
        @hookimpl
        def icefloe_register_backends(self) -> list[str]:
            return ["alpha"]

    with pytest.raises(PluginError, match="expected BackendSpec"):
        _plugins(Wrong()).backends()


def test_hook_raising_is_a_plugin_error_naming_the_plugin() -> None:
    class Raising:
        @hookimpl
        def icefloe_register_backends(self) -> list[BackendSpec]:
            raise RuntimeError("boom")

    plugins = new_plugins(autoload=False)
    plugins.pm.register(Raising(), name="raising-plugin")
    with pytest.raises(PluginError, match=r"raising-plugin.*RuntimeError: boom"):
        plugins.backends()


def test_open_backend_builds_the_configured_backend_and_it_works() -> None:
    server = MemoryServer()
    seen: list[tuple[Any, BackendContext]] = []

    def factory(config: NoOptions, context: BackendContext) -> Backend:
        seen.append((config, context))
        return MemoryBackend(server, context.group_id, context.lease_ttl_s)

    class InProcess:
        @hookimpl
        def icefloe_register_backends(self) -> list[BackendSpec]:
            return [_spec("inproc", factory)]

    plugins = _plugins(TwoBackends(), InProcess())
    cfg = _config("inproc", greeting="hi")
    assert backend_config(cfg, plugins) == NoOptions(greeting="hi")
    backend = open_backend(cfg, plugins)
    context = BackendContext("grp", 3.5, source_bootstrap_servers=cfg.source.bootstrap_servers)
    assert seen == [(NoOptions(greeting="hi"), context)]

    writer = backend.writer("w1")
    epoch = writer.open()
    ref = WriterRef("w1", epoch)
    event = Event("grp", DataComplete((SourcePosition("t", 0, 10),)), writer=ref, batch_seq=1)
    assert writer.publish(WriterBatch(ref, 1, (event,)))
    coordinator = backend.coordinator("c1")
    assert coordinator.acquire(1.0) is not None
    coordinator.seek(None)
    records = coordinator.poll(1.0)
    assert [r.event for r in records] == [event]
    coordinator.broadcast(Event("grp", StartCommit("c-1")))
    assert [e.payload for e in writer.poll_broadcasts(1.0)] == [StartCommit("c-1")]


def test_open_backend_with_an_unknown_name() -> None:
    with pytest.raises(UnknownBackendError, match="'nope'"):
        open_backend(_config("nope"), _plugins(TwoBackends()))


# --------------------------------------------------------------------------- codecs


def test_unknown_codec() -> None:
    with pytest.raises(UnknownCodecError, match=r"'protobuf' has no codec \(installed: none\)"):
        _plugins().codec("protobuf")


# --------------------------------------------------------------------------- notifications

COMMITTED = TableCommitted("grp", "db.t", "c-1", 42, 3, 300, None)


def test_after_table_commit_failures_are_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got: list[TableCommitted] = []

    class Failing:
        @hookimpl
        def icefloe_after_table_commit(self, event: TableCommitted) -> None:
            raise RuntimeError("metrics server down")

    class Recording:
        @hookimpl
        def icefloe_after_table_commit(self, event: TableCommitted) -> None:
            got.append(event)

    class NoArguments:
        @hookimpl
        def icefloe_after_table_commit(self) -> None:
            got.append(COMMITTED)

    plugins = new_plugins(autoload=False)
    plugins.pm.register(Recording(), name="recording")
    plugins.pm.register(Failing(), name="failing-notifier")
    plugins.pm.register(NoArguments(), name="no-args")
    with caplog.at_level(logging.ERROR, logger="icefloe.plugins"):
        plugins.after_table_commit(COMMITTED)
    assert got == [COMMITTED, COMMITTED]
    failures = [r for r in caplog.records if "failing-notifier" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].exc_info is not None
    assert "metrics server down" in str(failures[0].exc_info[1])


def test_backend_name_that_cannot_name_a_config_table_is_refused() -> None:
    class Dotted:
        @hookimpl
        def icefloe_register_backends(self) -> list[BackendSpec]:
            return [_spec("my.backend")]

    plugins = new_plugins(autoload=False)
    plugins.pm.register(Dotted(), name="dotted-plugin")
    with pytest.raises(PluginError, match=r"dotted-plugin.*'my\.backend'"):
        plugins.backends()


# --------------------------------------------------------------------------- through pluggy


def test_hook_wrappers_and_ordering_apply_to_backend_registration() -> None:
    """A third party's wrapper sees (and may change) what every plugin registered."""
    seen: list[list[str]] = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def icefloe_register_backends(self) -> Any:
            results = yield
            seen.append([spec.name for result in results for spec in result])
            return [[s for s in result if s.name != "beta"] for result in results]

    plugins = _plugins(TwoBackends(), Wrapper())
    assert sorted(plugins.backends()) == ["alpha"]
    assert seen == [["alpha", "beta"]]


def test_after_table_commit_goes_through_pluggy_with_wrappers_and_tryfirst() -> None:
    calls: list[str] = []

    class Late:
        @hookimpl
        def icefloe_after_table_commit(self, event: TableCommitted) -> None:
            calls.append("late")

    class First:
        @hookimpl(tryfirst=True)
        def icefloe_after_table_commit(self, event: TableCommitted) -> None:
            calls.append("first")

    class Around:
        @hookimpl(wrapper=True)
        def icefloe_after_table_commit(self, event: TableCommitted) -> Any:
            calls.append("wrap")
            return (yield)

    plugins = _plugins(First(), Late(), Around())
    plugins.after_table_commit(COMMITTED)
    assert calls == ["wrap", "first", "wrap", "late"]


# --------------------------------------------------------------------------- contract versions

#: A backend as written from the docs of the first contract (before versions existed): it
#: declares no version, and its coordinator channel has no channel_id / end_position.
CONTRACT_1_MODULE = """
from pydantic import BaseModel
from icefloe.hookspecs import BackendSpec, hookimpl

class Options(BaseModel):
    pass

def make(config, context):
    raise AssertionError("core must refuse the backend before building it")

@hookimpl
def icefloe_register_backends():
    return [BackendSpec("sqlite", Options, make, "a channel in a SQLite file"{contract})]
"""


def _contract_dist(root: Path, dist: str, contract: str = "") -> Plugins:
    mod = _module_name()
    make_dist(root, dist, {"sqlite": mod}, {mod: CONTRACT_1_MODULE.format(contract=contract)})
    return _load(root)


def test_a_backend_of_the_previous_contract_is_refused_at_load_in_one_line(
    dist_root: Path,
) -> None:
    """What the upgrade trial met as a TypeError under 13 unrelated rules: one line naming the
    backend, its distribution and version, what to implement (with the rules) and where the
    upgrade is documented, before the backend is built."""
    plugins = _contract_dist(dist_root, "icefloe-backend-sqlite")
    with pytest.raises(BackendContractError) as info:
        open_backend(_config("sqlite"), plugins)
    text = str(info.value)
    assert "\n" not in text
    assert "coordination backend 'sqlite' of icefloe-backend-sqlite 1.0" in text
    assert "declares no contract version (so contract 1)" in text
    assert f"drives backend contract {CONTRACT_VERSION}" in text
    for needed in (
        "CoordinatorChannel.channel_id()",
        "(rule 'Identity')",
        "CoordinatorChannel.end_position()",
        "(rule 'End position')",
        "Backend.inject_undecodable()",
        "(rule 'Bytes')",
        "BackendContext.resolve()",
        "contract=2",
    ):
        assert needed in text, needed
    assert "docs/backend-authors.md#from-contract-1-to-contract-2" in text
    with pytest.raises(BackendContractError):  # `icefloe show-config` and doctor's check
        backend_config(_config("sqlite"), plugins)


def test_a_backend_of_a_newer_contract_is_refused_asking_for_a_newer_core(
    dist_root: Path,
) -> None:
    plugins = _contract_dist(
        dist_root, "icefloe-backend-sqlite", f", contract={CONTRACT_VERSION + 1}"
    )
    with pytest.raises(BackendContractError) as info:
        open_backend(_config("sqlite"), plugins)
    text = str(info.value)
    assert f"implements backend contract {CONTRACT_VERSION + 1}, newer than" in text
    assert "upgrade icefloe-core" in text
    assert "icefloe-backend-sqlite 1.0" in text


def test_a_channel_missing_a_method_is_refused_naming_it_its_rule_and_the_upgrade() -> None:
    """A backend that declares the current contract but still lacks a method of it: the error
    names the methods and their rules, is typed (one clean line from the CLI) and is still the
    TypeError Python raised before."""

    class HalfUpgraded(MemoryCoordinatorChannel):  # contract 1's methods only
        channel_id = CoordinatorChannel.channel_id
        end_position = CoordinatorChannel.end_position

    with pytest.raises(MissingBackendMethodError) as info:
        HalfUpgraded(MemoryServer(), "grp", "c", 1.0)
    err = info.value
    assert isinstance(err, TypeError)
    assert isinstance(err, IcefloeError)
    assert err.missing == ("CoordinatorChannel.channel_id", "CoordinatorChannel.end_position")
    text = str(err)
    assert "HalfUpgraded does not implement CoordinatorChannel.channel_id() (rule 'Identity')" in (
        text
    )
    assert "CoordinatorChannel.end_position() (rule 'End position')" in text
    assert "new in contract 2: see docs/backend-authors.md#from-contract-1-to-contract-2" in text


def test_backends_command_shows_contract_and_origin_and_flags_the_outdated(
    dist_root: Path,
) -> None:
    plugins = _contract_dist(dist_root, "icefloe-backend-sqlite")
    plugins.pm.register(TwoBackends(), name="in-code")
    plugins_module.reset_plugins(plugins)
    try:
        result = CliRunner().invoke(cli_app, ["backends"])
    finally:
        plugins_module.reset_plugins(None)
    assert result.exit_code == 0, result.output
    lines = {
        line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("backend")
    }
    assert f"contract {CONTRACT_VERSION}" in lines["alpha"]
    assert "in-code" in lines["alpha"]
    assert "contract 1" in lines["sqlite"]
    assert "icefloe-backend-sqlite 1.0" in lines["sqlite"]
    assert "OUTDATED" in lines["sqlite"]
    assert "OUTDATED" not in lines["alpha"]
    refusals = [line for line in result.stderr.splitlines() if "'sqlite'" in line]
    assert len(refusals) == 1
    assert "docs/backend-authors.md#from-contract-1-to-contract-2" in refusals[0]


def test_doctor_fails_the_selected_outdated_backend_and_warns_about_other_outdated_ones(
    dist_root: Path,
) -> None:
    from icefloe.ops.doctor import run_checks

    class Alpha:
        @hookimpl
        def icefloe_register_backends(self) -> list[BackendSpec]:
            return [_spec("alpha", lambda c, ctx: MemoryBackend(MemoryServer(), ctx.group_id))]

    plugins = _contract_dist(dist_root, "icefloe-backend-sqlite")
    plugins.pm.register(Alpha(), name="in-code")
    plugins_module.reset_plugins(plugins)
    try:
        selected = run_checks(_config("sqlite"))
        other = run_checks(_config("alpha"))
    finally:
        plugins_module.reset_plugins(None)
    failed = [c for c in selected if c.status == "fail" and "sqlite" in c.name]
    assert [c.name for c in failed] == ["backend sqlite"], selected
    assert "icefloe-backend-sqlite 1.0" in failed[0].detail
    assert "#from-contract-1-to-contract-2" in failed[0].detail
    plugin_lines = {c.name: c for c in other if c.name.startswith("plugin")}
    assert plugin_lines["plugin icefloe-backend-sqlite"].status == "warn"
    assert "not selected" in plugin_lines["plugin icefloe-backend-sqlite"].detail
    ok = next(c for c in other if c.name == "plugins")
    assert f"alpha (contract {CONTRACT_VERSION}" in ok.detail
