"""Pipeline configuration: TOML, environment overrides, error messages, redaction, show-config."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, SecretStr, ValidationError
from typer.testing import CliRunner

from icefloe.cli.main import app
from icefloe.config import (
    REDACTED,
    PipelineConfig,
    config_error_from,
    config_from_dict,
    env_overrides,
    load_config,
    redact,
    redacted_dict,
)
from icefloe.errors import ConfigError
from icefloe.plugins import manager as plugins_module
from icefloe.plugins.backends import backend_config
from icefloe.testing.memory import MemoryBackendConfig

FULL_TOML = """
name = "orders-pipeline"

[source]
bootstrap_servers = "broker-1:9092,broker-2:9092"
topics = ["orders", "payments"]
format = "avro"
format_options = { schema_registry = "http://registry:8081" }
starting_offsets = { orders = { 0 = 15, 1 = 0 } }
max_records_per_batch = 5000

[source.kafka]
"security.protocol" = "SASL_SSL"
"sasl.mechanism" = "PLAIN"
"sasl.username" = "svc-orders"
"sasl.password" = "kafka-pw-Secret1"

[[tables]]
name = "db.orders"
route_field = "kind"
route_values = ["order"]
auto_create = true
partition_by = ["day(ts)"]
id_columns = ["id"]

[[tables]]
name = "db.payments"

[catalog]
name = "prod"

[catalog.properties]
type = "sql"
uri = "postgresql+psycopg://iceberg:catalog-pw-Secret2@db:5432/iceberg"
"s3.access-key-id" = "AKIAEXAMPLE"
"s3.secret-access-key" = "s3-Secret3"
"adls.account-key" = "adls-Secret4"
token = "rest-token-Secret5"

[coordination]
backend = "memory"
commit_interval_s = 5.0
commit_timeout_s = 20
max_pending_bytes = 1_000_000
max_pending_files = 100
writer_timeout_s = 60
lease_ttl_s = 4
branch = "audit"

[coordination.memory]
port = 12345
authkey = "deadbeef-Secret6"

[coordination.postgres]
dsn = "host=db user=icefloe password=pg-Secret7 dbname=icefloe"

[coordination.redis]
url = "redis://:redis-Secret8@cache:6379/0"

[spark]
master = "local[4]"
app_name = "orders"
checkpoint_location = "/tmp/ckpt"
trigger_interval_s = 0.5

[spark.conf]
"spark.hadoop.fs.s3a.secret.key" = "spark-Secret9"
"spark.sql.shuffle.partitions" = "4"
"""
SECRETS = [f"Secret{i}" for i in range(1, 10)]
MINIMAL: dict[str, Any] = {
    "name": "p",
    "source": {"topics": ["t"]},
    "tables": [{"name": "db.t"}],
}


@pytest.fixture
def full_toml(tmp_path: Path) -> Path:
    path = tmp_path / "pipeline.toml"
    path.write_text(FULL_TOML)
    return path


def _error(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return info.value


# --------------------------------------------------------------------------- loading


def test_full_toml_loads(full_toml: Path) -> None:
    cfg = load_config(full_toml, environ={})
    assert cfg.name == "orders-pipeline"
    assert cfg.source.topics == ["orders", "payments"]
    assert cfg.source.starting_offsets == {"orders": {"0": 15, "1": 0}}
    assert cfg.source.kafka["sasl.username"] == "svc-orders"
    assert [t.name for t in cfg.tables] == ["db.orders", "db.payments"]
    assert cfg.tables[0].partition_by == ["day(ts)"]
    assert cfg.catalog.name == "prod"
    assert cfg.catalog.properties["type"] == "sql"
    assert cfg.coordination.backend == "memory"
    assert cfg.coordination.commit_timeout_s == 20.0
    assert cfg.coordination.branch == "audit"
    assert cfg.coordination.backend_options() == {"port": 12345, "authkey": "deadbeef-Secret6"}
    assert cfg.spark.master == "local[4]"


def test_defaults() -> None:
    cfg = config_from_dict(MINIMAL)
    assert cfg.source.kind == "kafka"
    assert cfg.source.starting_offsets == "earliest"
    assert cfg.catalog.name == "default"
    assert cfg.coordination.backend == "kafka"
    assert cfg.coordination.commit_interval_s == 10.0
    assert cfg.coordination.backend_options() == {}
    assert cfg.spark.master == "local[2]"


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, environ={})


# --------------------------------------------------------------------------- environment


def test_env_overrides_nested_and_typed(full_toml: Path) -> None:
    env = {
        "ICEFLOE__COORDINATION__BACKEND": "redis",
        "ICEFLOE__COORDINATION__COMMIT_INTERVAL_S": "2.5",
        "ICEFLOE__COORDINATION__MAX_PENDING_FILES": "7",
        "ICEFLOE__COORDINATION__REDIS__URL": "redis://cache-2:6379/1",
        "ICEFLOE__COORDINATION__REDIS__PASSWORD": "0123",
        "ICEFLOE__SOURCE__TOPICS": '["a", "b"]',
        "ICEFLOE__SOURCE__STARTING_OFFSETS": "{ a = { 0 = 3 } }",
        "ICEFLOE__TABLES": '[{ name = "x.y" }]',
        "ICEFLOE__SPARK__CONF__PARALLELISM": "8",
        "ICEFLOE__NAME": "from-env",
        "UNRELATED": "1",
    }
    cfg = load_config(full_toml, environ=env)
    assert cfg.name == "from-env"
    assert cfg.coordination.backend == "redis"
    assert cfg.coordination.commit_interval_s == 2.5
    assert cfg.coordination.max_pending_files == 7
    assert cfg.coordination.commit_timeout_s == 20.0  # untouched keys keep the file's value
    # merged key by key with the file's [coordination.redis]; digits stay a string
    assert cfg.coordination.backend_options() == {
        "url": "redis://cache-2:6379/1",
        "password": "0123",
    }
    assert cfg.source.topics == ["a", "b"]
    assert cfg.source.starting_offsets == {"a": {"0": 3}}
    assert cfg.source.format == "avro"
    assert [t.name for t in cfg.tables] == ["x.y"]
    assert cfg.spark.conf["parallelism"] == "8"
    assert cfg.spark.conf["spark.sql.shuffle.partitions"] == "4"


def test_explicit_overrides_beat_environment() -> None:
    cfg = load_config(
        None,
        environ={"ICEFLOE__NAME": "env", "ICEFLOE__SOURCE__TOPICS": '["t"]'},
        overrides={"name": "explicit", "tables": [{"name": "db.t"}]},
    )
    assert cfg.name == "explicit"


def test_env_whole_table_then_one_key() -> None:
    env = {
        "ICEFLOE__COORDINATION__BACKEND": "redis",
        "ICEFLOE__COORDINATION": "{ backend = 'postgres', branch = 'b' }",
    }
    assert env_overrides(env) == {"coordination": {"backend": "redis", "branch": "b"}}


def test_env_key_inside_a_scalar_is_an_error() -> None:
    env = {"ICEFLOE__COORDINATION": "x", "ICEFLOE__COORDINATION__BACKEND": "redis"}
    with pytest.raises(ConfigError, match="is not a table") as info:
        env_overrides(env)
    assert info.value.key == "coordination"


def test_bad_env_value_names_the_variable(full_toml: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(full_toml, environ={"ICEFLOE__COORDINATION__COMMIT_INTERVAL_S": "soon"})
    err = info.value
    assert err.key == "coordination.commit_interval_s"
    assert err.value == "soon"
    assert "ICEFLOE__COORDINATION__COMMIT_INTERVAL_S" in err.fix


def test_bad_value_inside_an_env_table_names_the_variable(full_toml: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(full_toml, environ={"ICEFLOE__TABLES": '[{ name = "nodot" }]'})
    assert info.value.key == "tables.0.name"
    assert "ICEFLOE__TABLES" in info.value.fix


def test_process_environment_is_read_by_default(
    full_toml: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ICEFLOE__COORDINATION__BACKEND", "postgres")
    assert load_config(full_toml).coordination.backend == "postgres"


# --------------------------------------------------------------------------- errors


def test_missing_key() -> None:
    err = _error({"name": "p", "tables": [{"name": "db.t"}]})
    assert err.key == "source"
    assert err.fix == "add this key"
    assert "config key 'source'" in str(err)


def test_missing_nested_key() -> None:
    err = _error({**MINIMAL, "tables": [{}]})
    assert err.key == "tables.0.name"
    assert "add this key" in str(err)


def test_wrong_type_names_key_value_and_fix() -> None:
    err = _error({**MINIMAL, "coordination": {"commit_interval_s": "soon"}})
    assert err.key == "coordination.commit_interval_s"
    assert err.value == "soon"
    assert err.fix == "use a number"
    assert "'soon'" in str(err)
    assert "Fix: use a number" in str(err)


def test_wrong_type_in_a_list_item() -> None:
    err = _error({**MINIMAL, "tables": [{"name": "db.t", "auto_create": "maybe"}]})
    assert err.key == "tables.0.auto_create"
    assert err.fix == "use true or false"


def test_unknown_key() -> None:
    err = _error({**MINIMAL, "source": {"topics": ["t"], "topic": "x"}})
    assert err.key == "source.topic"
    assert err.value == "x"
    assert "spelling" in err.fix


def test_misspelt_coordination_key_is_not_taken_for_a_backend_section() -> None:
    err = _error({**MINIMAL, "coordination": {"commit_intervl_s": 5}})
    assert err.key == "coordination.commit_intervl_s"
    assert err.problem == "unknown key"
    assert "spelling" in err.fix
    assert "[coordination.<backend>]" in err.fix


@pytest.mark.parametrize(
    ("data", "key", "meant"),
    [
        ({"source": {"topics": ["t"], "bootstrap_server": "x"}}, "source", "bootstrap_servers"),
        ({"tables": [{"name": "db.t", "auto_creat": True}]}, "tables.0", "auto_create"),
        ({"coordination": {"comit_interval_s": 3}}, "coordination", "commit_interval_s"),
        ({"catalogue": {}}, "", "catalog"),
    ],
)
def test_misspelt_key_gets_did_you_mean(data: dict[str, Any], key: str, meant: str) -> None:
    """Issue 24 item 7: a misspelt key names the key it resembles, as reader options do."""
    err = _error({**MINIMAL, **data})
    assert err.fix.startswith(f"did you mean '{meant}'?"), err
    assert err.key.rpartition(".")[0] == key, err


def test_misspelt_backend_key_gets_did_you_mean(memory_plugins: plugins_module.Plugins) -> None:
    options = {"port": 1, "authkey": "ab", "hots": "h"}
    cfg = config_from_dict({**MINIMAL, "coordination": {"backend": "memory", "memory": options}})
    with pytest.raises(ConfigError) as info:
        backend_config(cfg, memory_plugins)
    assert info.value.key == "coordination.memory.hots"
    assert info.value.fix.startswith("did you mean 'host'?"), info.value


def test_bad_literal_lists_the_allowed_values() -> None:
    err = _error({**MINIMAL, "source": {"topics": ["t"], "kind": "pulsar"}})
    assert err.key == "source.kind"
    assert err.value == "pulsar"
    assert "'kafka'" in err.fix


def test_bad_starting_offsets_gives_one_clear_error() -> None:
    err = _error({**MINIMAL, "source": {"topics": ["t"], "starting_offsets": "newest"}})
    assert err.key == "source.starting_offsets"
    assert "'earliest', 'latest', 'table'" in err.fix
    assert "All problems" not in str(err)


def test_constraint_errors() -> None:
    assert "greater than 0" in _error({**MINIMAL, "coordination": {"lease_ttl_s": 0}}).fix
    assert "at least one [[tables]] entry" in _error({**MINIMAL, "tables": []}).fix
    err = _error({**MINIMAL, "name": "has space"})
    assert err.key == "name"
    assert "letters, digits" in err.fix


def test_duplicate_table() -> None:
    err = _error({**MINIMAL, "tables": [{"name": "db.t"}, {"name": "db.t"}]})
    assert err.key == "tables"
    assert "listed twice" in err.fix


def test_several_problems_are_all_listed() -> None:
    err = _error({"name": "p", "source": {"topics": ["t"], "kind": "x"}, "tables": [{"name": "t"}]})
    assert "All problems" in str(err)
    assert "source.kind" in str(err)
    assert "tables.0.name" in str(err)


def test_backend_section_is_validated_by_the_backends_model(
    memory_plugins: plugins_module.Plugins,
) -> None:
    cfg = config_from_dict(
        {**MINIMAL, "coordination": {"backend": "memory", "memory": {"port": 1, "authkey": "ab"}}}
    )
    section = backend_config(cfg, memory_plugins)
    assert isinstance(section, MemoryBackendConfig)
    assert section.port == 1

    cfg = config_from_dict(
        {**MINIMAL, "coordination": {"backend": "memory", "memory": {"port": "x", "authkey": "ab"}}}
    )
    with pytest.raises(ConfigError) as info:
        backend_config(cfg, memory_plugins)
    assert info.value.key == "coordination.memory.port"
    assert info.value.fix == "use a whole number"

    cfg = config_from_dict(
        {**MINIMAL, "coordination": {"backend": "memory", "memory": {"port": 1}}}
    )
    with pytest.raises(ConfigError) as info:
        backend_config(cfg, memory_plugins)
    assert info.value.key == "coordination.memory.authkey"

    cfg = config_from_dict(
        {
            **MINIMAL,
            "coordination": {"backend": "memory", "memory": {"port": 1, "authkey": "a", "prot": 2}},
        }
    )
    with pytest.raises(ConfigError) as info:
        backend_config(cfg, memory_plugins)
    assert info.value.key == "coordination.memory.prot"


def test_backend_name_with_a_dot_is_refused() -> None:
    err = _error({**MINIMAL, "coordination": {"backend": "my.backend"}})
    assert err.key == "coordination.backend"
    assert err.value == "my.backend"


def test_backend_section_must_be_a_table() -> None:
    err = _error({**MINIMAL, "coordination": {"backend": "memory", "memory": "port=1"}})
    assert err.key == "coordination.memory"


def test_error_never_shows_a_secret_value() -> None:
    class Model(BaseModel):
        password: str
        dsn: int

    with pytest.raises(ValidationError) as info:
        Model.model_validate(
            {"password": ["hunter2-Secret"], "dsn": "postgresql://u:pw-Secret@h/db"}
        )
    err = config_error_from(info.value, prefix="coordination.pg.")
    assert err.key == "coordination.pg.password"
    assert "Secret" not in str(err)
    assert REDACTED in str(err)


# --------------------------------------------------------------------------- redaction


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("password", "x"),
        ("sasl.password", "x"),
        ("ssl.key.password", "x"),
        ("sasl.jaas.config", 'org.apache...PlainLoginModule required password="x";'),
        ("s3.secret-access-key", "x"),
        ("adls.account-key", "x"),
        ("adls.sas-token", "x"),
        ("token", "x"),
        ("gcs.oauth2.token", "x"),
        ("credential", "x"),
        ("client_secret", "x"),
        ("api_key", "x"),
        ("authkey", "x"),
        ("private_key", "x"),
        ("password", 12345),
        ("password", ["a", "b"]),
        ("credentials", {"user": "a", "blob": "x"}),
    ],
)
def test_secret_keys_are_masked_whatever_the_value(key: str, value: Any) -> None:
    assert redact({key: value}) == {key: REDACTED}


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("postgresql://icefloe:pw1@db:5432/x", f"postgresql://icefloe:{REDACTED}@db:5432/x"),
        ("redis://:pw2@cache:6379/0", f"redis://:{REDACTED}@cache:6379/0"),
        ("rediss://user:p/w@cache", f"rediss://user:{REDACTED}@cache"),
        ("host=db password=pw3 dbname=x", f"host=db password={REDACTED} dbname=x"),
        (
            "jdbc:x://h/db?user=u&password=pw4&ssl=1",
            f"jdbc:x://h/db?user=u&password={REDACTED}&ssl=1",
        ),
        ("http://registry:8081", "http://registry:8081"),
        ("broker-1:9092", "broker-1:9092"),
    ],
)
def test_passwords_inside_urls_and_dsns_are_masked(value: str, shown: str) -> None:
    assert redact({"dsn": value}) == {"dsn": shown}
    assert redact([value]) == [shown]


def test_secret_str_is_masked() -> None:
    assert redact({"anything": SecretStr("x")}) == {"anything": REDACTED}


def test_non_secrets_stay_visible() -> None:
    data = {"s3.access-key-id": "AKIA", "topics": ["a"], "sasl.username": "svc", "port": 1}
    assert redact(data) == data


def test_redacted_dict_of_a_full_config_holds_no_secret(full_toml: Path) -> None:
    text = json.dumps(redacted_dict(load_config(full_toml, environ={})), default=str)
    for secret in SECRETS:
        assert secret not in text
    assert "svc-orders" in text
    assert "iceberg:***@db:5432" in text
    assert "AKIAEXAMPLE" in text


# --------------------------------------------------------------------------- show-config


def test_show_config_prints_the_config_without_secrets(
    full_toml: Path, memory_plugins: plugins_module.Plugins, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ICEFLOE__COORDINATION__BACKEND", raising=False)
    result = CliRunner().invoke(app, ["show-config", "--config", str(full_toml)])
    assert result.exit_code == 0, result.output
    for secret in SECRETS:
        assert secret not in result.output
    shown = tomllib.loads(result.stdout)  # TOML for a TOML config
    assert shown["name"] == "orders-pipeline"
    assert shown["coordination"]["memory"] == {
        "host": "127.0.0.1",
        "port": 12345,
        "authkey": REDACTED,
    }
    assert shown["source"]["kafka"]["sasl.password"] == REDACTED
    assert shown["catalog"]["properties"]["s3.secret-access-key"] == REDACTED
    PipelineConfig.model_validate({**shown, "coordination": {"backend": "memory"}})


def test_show_config_with_an_unknown_backend_still_hides_secrets(
    full_toml: Path, memory_plugins: plugins_module.Plugins, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ICEFLOE__COORDINATION__BACKEND", "postgres")
    result = CliRunner().invoke(app, ["show-config", "--config", str(full_toml), "--json"])
    assert result.exit_code == 0, result.output
    assert "backend section not validated" in result.output
    assert (
        "coordination backend 'postgres' (set by ICEFLOE__COORDINATION__BACKEND) is not installed"
        in result.output
    )
    for secret in SECRETS:
        assert secret not in result.output
    assert json.loads(result.stdout)["coordination"]["backend"] == "postgres"


def test_source_takes_topics_or_a_pattern_exactly_one() -> None:
    base: dict[str, Any] = {"name": "p", "tables": [{"name": "db.t"}]}
    for source in ({}, {"topics": ["a"], "topic_pattern": "a.*"}):
        with pytest.raises(ConfigError) as err:
            config_from_dict({**base, "source": source})
        assert "source.topics" in str(err.value)
        assert "source.topic_pattern" in str(err.value)
    with pytest.raises(ConfigError, match=r"source\.topic_pattern"):
        config_from_dict({**base, "source": {"topic_pattern": "("}})
    src = config_from_dict({**base, "source": {"topic_pattern": "ord.*"}}).source
    assert src.subscribed(["orders", "xorders", "__ord", "ord"]) == ["ord", "orders"]


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        ("tables", "compact_delete_ratio", 0),
        ("tables", "compact_delete_files", 0),
        ("tables", "compact_small_files", 1),
        ("coordination", "compaction_budget_s", 0),
    ],
)
def test_compaction_keys_are_validated_and_errors_name_the_key(
    where: str, key: str, value: float
) -> None:
    table = {"name": "db.t", "mode": "upsert", "id_columns": ["id"], "compact": True}
    if where == "tables":
        data = {**MINIMAL, "tables": [{**table, key: value}]}
        name = f"tables.0.{key}"
    else:
        data = {**MINIMAL, "tables": [table], "coordination": {key: value}}
        name = f"coordination.{key}"
    assert name in str(_error(data))


def test_compaction_policy_follows_the_table_keys() -> None:
    from icefloe.commit.policy import TablePolicies

    table = {"name": "db.t", "compact": True, "compact_delete_files": 3}
    policies = TablePolicies.from_config(config_from_dict({**MINIMAL, "tables": [table]}))
    thresholds = policies("db.t").compaction
    assert thresholds is not None
    assert (thresholds.delete_files, thresholds.delete_ratio, thresholds.small_files) == (
        3,
        0.2,
        16,
    )
    assert policies("db.other").compaction is None  # off unless a table asks
