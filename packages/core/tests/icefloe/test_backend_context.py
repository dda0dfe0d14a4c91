"""The backend factory learns the pipeline file's directory, in every process: relative paths
in a backend's section resolve against the file, not against each process's working dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from icefloe.channel import Backend
from icefloe.config import PipelineConfig, load_config
from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl
from icefloe.plugins.backends import open_backend
from icefloe.plugins.manager import new_plugins
from icefloe.testing.memory import MemoryBackend, MemoryServer

PIPELINE = """
name = "ctx"
{extra}
[source]
topics = ["t"]

[[tables]]
name = "db.t"

[coordination]
backend = "ctx"

[coordination.ctx]
directory = "channel"
"""


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    directory: str


def _open(config: PipelineConfig) -> tuple[BackendContext, Path]:
    seen: list[tuple[BackendContext, Path]] = []

    def factory(options: _Options, context: BackendContext) -> Backend:
        seen.append((context, context.resolve(options.directory)))
        return MemoryBackend(MemoryServer(), context.group_id)

    class Plugin:
        @hookimpl
        def icefloe_register_backends(self) -> list[BackendSpec]:
            return [BackendSpec("ctx", _Options, factory, contract=2)]

    plugins = new_plugins(autoload=False)
    plugins.pm.register(Plugin())
    open_backend(config, plugins)
    return seen[0]


def test_relative_backend_paths_mean_the_pipeline_files_directory_in_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "pipeline.toml").write_text(PIPELINE.format(extra=""))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)
    config = load_config(Path("conf") / "pipeline.toml")
    context, directory = _open(config)
    assert context.config_dir == conf_dir.resolve()
    assert directory == conf_dir.resolve() / "channel"
    # an executor gets the config as JSON and runs in another working directory
    monkeypatch.chdir(elsewhere)
    shipped = PipelineConfig.model_validate_json(config.model_dump_json())
    assert _open(shipped)[1] == conf_dir.resolve() / "channel"
    assert os.getcwd() == str(elsewhere)


def test_a_config_dir_in_the_file_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "pipeline.toml").write_text(PIPELINE.format(extra='config_dir = "state"'))
    context, directory = _open(load_config(tmp_path / "pipeline.toml"))
    assert context.config_dir == (tmp_path / "state").resolve()
    assert directory == (tmp_path / "state" / "channel").resolve()


def test_a_config_built_in_code_resolves_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    context = BackendContext("g")
    assert context.config_dir is None
    assert context.resolve("x") == tmp_path / "x"
    assert context.resolve("/abs/x") == Path("/abs/x")
