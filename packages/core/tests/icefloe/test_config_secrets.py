"""Secrets taken from the environment or a file (``${env:NAME}``, ``${file:PATH}``): resolved
when the configuration is loaded, errors that name the key and the fix, and never shown."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from icefloe.cli.main import app
from icefloe.config import load_config
from icefloe.errors import ConfigError
from icefloe.plugins import manager as plugins_module

pytestmark = pytest.mark.unit

KAFKA_PW = "kafka-pw-Sekrit1"
TOKEN = "rest-token-Sekrit2"
CATALOG_URI = "postgresql+psycopg://iceberg:catalog-Sekrit3@db:5432/iceberg"

PIPELINE = """
name = "p"

[source]
topics = ["t"]

[source.kafka]
"sasl.username" = "svc"
"sasl.password" = "${file:secrets/kafka.pw}"

[[tables]]
name = "db.t"

[catalog.properties]
uri = "${file:/ABS/catalog.uri}"
token = "${env:REST_TOKEN}"

[coordination]
backend = "memory"

[coordination.memory]
authkey = "${env:MEMORY_AUTHKEY}"
"""


@pytest.fixture
def pipeline(tmp_path: Path) -> Path:
    """A pipeline file whose secrets live in files beside it and in the environment."""
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "kafka.pw").write_text(KAFKA_PW + "\n")  # as `echo` writes it
    (tmp_path / "catalog.uri").write_text(CATALOG_URI)
    path = tmp_path / "pipeline.toml"
    path.write_text(PIPELINE.replace("/ABS", str(tmp_path)))
    return path


def environ(**extra: str) -> dict[str, str]:
    return {"REST_TOKEN": TOKEN, "MEMORY_AUTHKEY": "authkey-Sekrit4", **extra}


def test_references_are_resolved_from_files_and_the_environment(pipeline: Path) -> None:
    cfg = load_config(pipeline, environ=environ())
    # a relative path starts at the pipeline file's directory; one final newline is dropped
    assert cfg.source.kafka["sasl.password"] == KAFKA_PW
    assert cfg.catalog.properties == {"uri": CATALOG_URI, "token": TOKEN}
    assert cfg.coordination.backend_options() == {"authkey": "authkey-Sekrit4"}


def test_a_reference_may_come_from_an_environment_override(pipeline: Path) -> None:
    cfg = load_config(
        pipeline, environ=environ(ICEFLOE__CATALOG__PROPERTIES__TOKEN="${env:OTHER}", OTHER="o")
    )
    assert cfg.catalog.properties["token"] == "o"


def test_an_unset_variable_names_the_key_and_the_fix(pipeline: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(pipeline, environ={"MEMORY_AUTHKEY": "x"})
    err = info.value
    assert err.key == "catalog.properties.token"
    assert "REST_TOKEN" in err.problem
    assert "export REST_TOKEN" in err.fix


def test_an_unreadable_file_names_the_key_the_path_and_the_fix(pipeline: Path) -> None:
    (pipeline.parent / "secrets" / "kafka.pw").unlink()
    with pytest.raises(ConfigError) as info:
        load_config(pipeline, environ=environ())
    err = info.value
    assert err.key == "source.kafka.sasl.password"
    assert str(pipeline.parent / "secrets" / "kafka.pw") in err.problem
    assert "No such file" in err.problem
    assert "readable file" in err.fix


def test_a_bad_value_from_a_reference_is_named_by_its_reference_not_shown(
    pipeline: Path,
) -> None:
    env = environ(ICEFLOE__COORDINATION__COMMIT_INTERVAL_S="${env:INTERVAL}", INTERVAL="Sekrit5")
    with pytest.raises(ConfigError) as info:
        load_config(pipeline, environ=env)
    err = info.value
    assert err.key == "coordination.commit_interval_s"
    assert "Sekrit5" not in str(err)
    assert err.value == "${env:INTERVAL}"


def test_show_config_shows_where_a_secret_comes_from_never_the_secret(
    pipeline: Path,
    memory_plugins: plugins_module.Plugins,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in environ().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ICEFLOE__COORDINATION__BACKEND", raising=False)
    result = CliRunner().invoke(app, ["show-config", "--config", str(pipeline)])
    assert result.exit_code == 0, result.output
    assert "Sekrit" not in result.output
    shown = tomllib.loads(result.stdout)
    assert shown["source"]["kafka"]["sasl.password"] == "${file:secrets/kafka.pw}"
    # not a secret-looking key, yet it came from a reference: the reference is shown
    assert shown["catalog"]["properties"]["uri"] == f"${{file:{pipeline.parent}/catalog.uri}}"
    assert shown["coordination"]["memory"]["authkey"] == "${env:MEMORY_AUTHKEY}"
    as_json = CliRunner().invoke(app, ["show-config", "--config", str(pipeline), "--json"])
    assert json.loads(as_json.stdout)["catalog"]["properties"]["token"] == "${env:REST_TOKEN}"
