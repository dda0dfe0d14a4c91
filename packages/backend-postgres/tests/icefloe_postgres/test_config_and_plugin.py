"""Configuration, secrets handling and registration through the ``icefloe`` entry point."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from icefloe.config import PipelineConfig, config_from_dict, redacted_dict
from icefloe.errors import ChannelError, ConfigError
from icefloe.plugins.backends import open_backend
from icefloe.plugins.manager import new_plugins
from icefloe_postgres import PostgresBackend, PostgresConfig
from icefloe_postgres.config import describe_dsn
from icefloe_postgres.testing import BackendMaker

SECRET = "s3cr3t-pw"


def pipeline(name: str, **coordination: Any) -> PipelineConfig:
    """A pipeline of one topic and one table, with this ``coordination`` section."""
    base = {"name": name, "source": {"topics": ["t"]}, "tables": [{"name": "ns.t"}]}
    return config_from_dict({**base, "coordination": coordination})


def test_dsn_from_the_named_environment_variable() -> None:
    cfg = PostgresConfig.model_validate({"dsn_env": "MY_PG"})
    assert cfg.resolve_dsn({"MY_PG": "host=db dbname=x"}) == "host=db dbname=x"


def test_missing_dsn_names_the_key_and_the_fix() -> None:
    cfg = PostgresConfig()
    with pytest.raises(ConfigError) as err:
        cfg.resolve_dsn({})
    assert err.value.key == "coordination.postgres.dsn"
    assert "ICEFLOE_POSTGRES_DSN" in str(err.value)


def test_invalid_dsn_error_does_not_echo_the_secret() -> None:
    cfg = PostgresConfig.model_validate({"dsn": f"password={SECRET} host=x 'broken"})
    with pytest.raises(ConfigError) as err:
        cfg.resolve_dsn()
    assert SECRET not in str(err.value)


def test_secret_never_shown() -> None:
    dsn = f"postgresql://icefloe:{SECRET}@db.example:5433/pipes"
    cfg = PostgresConfig.model_validate({"dsn": dsn, "schema": "s"})
    assert SECRET not in repr(cfg)
    assert SECRET not in str(cfg)
    assert SECRET not in str(redacted_dict(cfg))
    shown = describe_dsn(dsn)
    assert SECRET not in shown
    assert "db.example" in shown
    assert "5433" in shown
    assert SECRET not in describe_dsn(f"host=h password={SECRET}")


def test_unreachable_server_error_and_logs_hide_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = PostgresConfig.model_validate(
        {
            # port 1 is never a PostgreSQL server: connection refused at once
            "dsn": f"host=127.0.0.1 port=1 user=u password={SECRET} dbname=x",
            "retry_timeout_s": 0.5,
            "pool_timeout_s": 0.2,
            "pool_min_size": 0,
        }
    )
    with pytest.raises(ChannelError) as err:
        PostgresBackend(cfg, "g")
    assert SECRET not in str(err.value)
    assert "127.0.0.1" in str(err.value)
    assert SECRET not in caplog.text


def test_pool_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="pool_min_size"):
        PostgresConfig.model_validate({"pool_min_size": 5, "pool_max_size": 2})


def test_registered_through_the_entry_point_and_opened_from_pipeline_config(
    pg_dsn: str, session_schema: str
) -> None:
    plugins = new_plugins(autoload=True)
    spec = plugins.backend("postgres")
    assert spec.config_model is PostgresConfig
    config = pipeline(
        "cfg-pipeline",
        backend="postgres",
        lease_ttl_s=3.0,
        postgres={"dsn": pg_dsn, "schema": session_schema, "pool_min_size": 0},
    )
    backend = open_backend(config, plugins)
    try:
        assert isinstance(backend, PostgresBackend)
        assert backend.group_id == "cfg-pipeline"
        assert backend.lease_ttl_s == 3.0
        assert backend.schema == session_schema
    finally:
        backend.close()


def test_unknown_key_is_a_config_error_naming_it(pg_dsn: str) -> None:
    from icefloe.plugins.backends import backend_config

    config = pipeline("p", backend="postgres", postgres={"dns": pg_dsn})
    with pytest.raises(ConfigError) as err:
        backend_config(config, new_plugins(autoload=True))
    assert err.value.key == "coordination.postgres.dns"


def test_doctor_warns_when_synchronous_commit_is_off(
    pg_dsn: str, make_backend: BackendMaker
) -> None:
    assert make_backend().doctor() == []
    # a per-session setting, given to every connection of this backend through its DSN
    lax = make_backend(dsn=f"{pg_dsn} options='-c synchronous_commit=off'")
    assert any("synchronous_commit is off" in w for w in lax.doctor())
