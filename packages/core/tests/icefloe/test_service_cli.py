"""The command line as an operator meets it: version, help, TOML output, error messages that
name the right thing (and never an invented package), logging options."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from icefloe import __version__
from icefloe.cli.logs import JsonFormatter, configure, resolve_level
from icefloe.cli.main import app
from icefloe.config import config_from_dict, load_config
from icefloe.errors import ConfigError, UnknownBackendError
from icefloe.plugins import manager as plugins_module
from icefloe.plugins.backends import backend_config
from icefloe.testing.cli import run_icefloe

BASE: dict[str, Any] = {
    "name": "p",
    "source": {"topics": ["t"]},
    "tables": [{"name": "db.t"}],
    "coordination": {"backend": "memory"},
}


def test_version_flag() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"icefloe {__version__}"


def test_boolean_flags_show_no_value_placeholder() -> None:
    out = run_icefloe("coordinator", "--help")
    assert out.returncode == 0, out.stderr
    verbose = next(line for line in out.stdout.splitlines() if "--verbose" in line)
    assert "<bool>" not in verbose
    assert "<bool>" not in out.stdout
    assert " PATH " in out.stdout  # options that take a value still show it


def test_help_at_80_columns_shows_every_option_whole_with_plain_placeholders() -> None:
    """No `<list[str]>` or `<int range>` (Python types), no option name cut to `--expire-o…`."""
    from icefloe.cli.main import build_command

    root = build_command()
    for name, command in root.commands.items():
        if hasattr(command, "commands"):
            continue  # a group (quarantine): its own commands' help is alike
        help_text = subprocess_help(name)
        for param in command.params:
            if param.param_type_name == "option":
                for opt in param.opts:
                    assert opt in help_text, (name, opt, help_text)
        for python_type in ("<bool>", "<list[", "<str>", "<int", "<path>", "<float>"):
            options = help_text.split("Options", 1)[-1]  # arguments keep typer's own
            assert python_type not in options, (name, python_type, help_text)
        assert "…" not in help_text, (name, help_text)


def subprocess_help(command: str) -> str:
    """``icefloe COMMAND --help`` as a pipe at 80 columns reads it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
    out = subprocess.run(
        [sys.executable, "-m", "icefloe", command, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return out.stdout


def _unknown_backend(name: str, plugins: plugins_module.Plugins) -> str:
    """The message of the error ``coordination.backend = name`` gets."""
    cfg = config_from_dict({**BASE, "coordination": {"backend": name}})
    with pytest.raises(UnknownBackendError) as info:
        backend_config(cfg, plugins)
    return str(info.value)


def test_misspelt_backend_suggests_the_known_one_never_an_invented_package(
    memory_plugins: plugins_module.Plugins,
) -> None:
    text = _unknown_backend("postgress", memory_plugins)
    assert "did you mean 'postgres'?" in text
    assert "pip install icefloe-backend-postgres`" in text
    assert "icefloe-backend-postgress" not in text


def test_unknown_backend_resembling_nothing_suggests_no_package(
    memory_plugins: plugins_module.Plugins,
) -> None:
    text = _unknown_backend("zookeeper", memory_plugins)
    assert "pip install" not in text
    assert "did you mean" not in text


def test_unknown_backend_is_one_clear_sentence_naming_what_to_install(
    memory_plugins: plugins_module.Plugins,
) -> None:
    """Issue 24 item 7: the message read ``(installed: memory). or set ...``."""
    assert _unknown_backend("nats", memory_plugins) == (
        "coordination backend 'nats' is not installed (installed: memory). Fix: install the "
        "package that registers backend 'nats' (an icefloe plugin; `icefloe backends` lists "
        "what is installed) or set coordination.backend to one of: memory"
    )


def test_misspelt_installed_backend_suggests_it(memory_plugins: plugins_module.Plugins) -> None:
    cfg = config_from_dict({**BASE, "coordination": {"backend": "memroy"}})
    with pytest.raises(UnknownBackendError, match="did you mean 'memory'"):
        backend_config(cfg, memory_plugins)


def test_environment_override_of_the_backend_is_named(
    memory_plugins: plugins_module.Plugins, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "p.toml"
    path.write_text('name = "p"\n[source]\ntopics = ["t"]\n[[tables]]\nname = "db.t"\n')
    monkeypatch.setenv("ICEFLOE__COORDINATION__BACKEND", "redsi")
    cfg = load_config(path)
    with pytest.raises(UnknownBackendError) as info:
        backend_config(cfg, memory_plugins)
    assert "(set by ICEFLOE__COORDINATION__BACKEND)" in str(info.value)
    assert "did you mean 'redis'?" in str(info.value)


def test_misspelt_backend_section_is_named(memory_plugins: plugins_module.Plugins) -> None:
    cfg = config_from_dict(
        {**BASE, "coordination": {"backend": "memory", "memroy": {"port": 1, "authkey": "00"}}}
    )
    with pytest.raises(ConfigError) as info:
        backend_config(cfg, memory_plugins)
    assert info.value.key == "coordination.memroy"
    assert "did you mean [coordination.memory]" in str(info.value)


def test_sections_of_other_known_backends_may_stay(memory_plugins: plugins_module.Plugins) -> None:
    cfg = config_from_dict(
        {
            **BASE,
            "coordination": {
                "backend": "memory",
                "memory": {"port": 1, "authkey": "00"},
                "postgres": {"dsn": "x"},
            },
        }
    )
    backend_config(cfg, memory_plugins)  # no error: switching backend is one key


def test_table_name_error_says_namespace_table_not_a_regex() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({**BASE, "tables": [{"name": "orders"}]})
    text = str(info.value)
    assert info.value.key == "tables.0.name"
    assert '"namespace.table"' in text
    assert "^" not in text
    assert "\\s" not in text


def test_log_level_options() -> None:
    assert resolve_level(None) == logging.INFO
    assert resolve_level(None, verbose=True) == logging.DEBUG
    assert resolve_level(None, quiet=True) == logging.WARNING
    assert resolve_level("ERROR", verbose=True) == logging.ERROR  # explicit level wins
    with pytest.raises(ConfigError, match="--log-level"):
        resolve_level("loud")


def test_json_log_lines_carry_extra_fields() -> None:
    record = logging.LogRecord("icefloe.progress", logging.INFO, "f", 1, "x %s", ("y",), None)
    record.table = "db.t"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "x y"
    assert line["level"] == "info"
    assert line["table"] == "db.t"


def test_without_details_a_run_logs_its_progress_lines_not_each_commit_twice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`icefloe run` (details=False) logs one line per table commit (its progress log) and
    one a minute: the committer's line per table and the coordinator's per cycle say the same
    again, so they wait for -v. A standalone coordinator keeps them."""

    def emitted() -> list[str]:
        for name in ("icefloe.committer", "icefloe.coordinator.cycles", "icefloe.progress"):
            logging.getLogger(name).info("from %s", name)
        return [ln.rsplit(" ", 1)[-1] for ln in capsys.readouterr().err.splitlines()]

    try:
        configure(logging.INFO, details=False)
        assert emitted() == ["icefloe.progress"]
        configure(logging.DEBUG, details=False)
        assert len(emitted()) == 3
        configure(logging.INFO)  # the standalone coordinator's set-up
        assert len(emitted()) == 3
    finally:
        configure(logging.WARNING)


def test_status_says_only_what_the_backend_can_tell_of_the_lease() -> None:
    """Redis records no acquisition time: no `lease age ?`, the expiry alone."""
    from icefloe.channel import BackendStatus
    from icefloe.ops.status import PipelineStatus, render_lines

    def lease_line(backend: BackendStatus) -> str:
        return render_lines(PipelineStatus("p", "redis", backend, None))[1]

    assert (
        lease_line(BackendStatus("c1", 3, None, 7.2, ()))
        == "  leader c1  token 3  lease expires in 7s"
    )
    assert lease_line(BackendStatus("c1", 3, 12.0, 7.2, ())) == (
        "  leader c1  token 3  lease age 12s, expires in 7s"
    )
    assert lease_line(BackendStatus()) == "  leader -  token -"
