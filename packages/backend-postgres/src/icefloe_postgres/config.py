"""Configuration of the PostgreSQL backend: the ``[coordination.postgres]`` section."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from icefloe.errors import ConfigError

SECTION = "coordination.postgres"
DEFAULT_DSN_ENV = "ICEFLOE_POSTGRES_DSN"


def _seconds(default: float, description: str, *, zero_allowed: bool = False) -> Any:
    """A duration setting: more than 0 s, or with ``zero_allowed`` at least 0 s."""
    if zero_allowed:
        return Field(default=default, ge=0, description=description)
    return Field(default=default, gt=0, description=description)


class PostgresConfig(BaseModel):
    """Connection, schema, pool and retention settings.

    The DSN is a secret (it may carry a password): it is held as a ``SecretStr`` and only ever
    shown through :func:`describe_dsn`, which drops the password.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    dsn: SecretStr | None = Field(
        default=None, description="libpq connection string or URL; prefer dsn_env for secrets"
    )
    dsn_env: str = Field(
        default=DEFAULT_DSN_ENV,
        min_length=1,
        description="environment variable holding the DSN when `dsn` is not set",
    )
    schema_name: str = Field(
        default="icefloe",
        alias="schema",
        min_length=1,
        max_length=63,
        description="schema holding the backend's tables (created by its migrations)",
    )
    pool_min_size: int = Field(default=1, ge=0)
    pool_max_size: int = Field(default=4, ge=1)
    pool_timeout_s: float = Field(default=10.0, gt=0)
    connect_timeout_s: int = Field(default=5, ge=1)
    retry_timeout_s: float = _seconds(
        30.0, "how long an operation keeps retrying after connection loss"
    )
    retention_s: float = _seconds(
        3600.0, "minimum age of a committed event before prune() deletes it", zero_allowed=True
    )
    broadcast_retention_s: float = _seconds(
        600.0,
        "minimum age of a coordinator broadcast before prune() deletes it",
        zero_allowed=True,
    )
    poll_interval_s: float = _seconds(
        1.0, "fallback polling interval when no LISTEN/NOTIFY wake-up arrives"
    )
    transaction_timeout_s: float = _seconds(
        60.0, "idle-in-transaction limit: a paused client cannot hold the append lock for longer"
    )
    application_name: str = Field(default="icefloe", max_length=63)

    @model_validator(mode="after")
    def _pool_sizes(self) -> PostgresConfig:
        if self.pool_min_size > self.pool_max_size:
            raise ValueError(
                f"pool_min_size ({self.pool_min_size}) must not exceed "
                f"pool_max_size ({self.pool_max_size})"
            )
        return self

    def resolve_dsn(self, environ: Mapping[str, str] | None = None) -> str:
        """The DSN to connect with: ``dsn`` if set, else the variable named by ``dsn_env``."""
        if self.dsn is not None:
            value = self.dsn.get_secret_value()
            key = f"{SECTION}.dsn"
        else:
            env = os.environ if environ is None else environ
            value = env.get(self.dsn_env, "")
            key = f"{SECTION}.dsn_env"
            if not value:
                raise ConfigError(
                    f"{SECTION}.dsn",
                    f"no DSN configured and environment variable {self.dsn_env} is not set",
                    f"set {SECTION}.dsn, or export {self.dsn_env}='host=... dbname=... user=...'",
                )
        if parse_dsn(value) is None:
            raise ConfigError(
                key, "is not a valid libpq connection string", "use 'key=value ...' or a URL"
            )
        return value


def parse_dsn(dsn: str) -> dict[str, Any] | None:
    """The DSN's parameters, or None where libpq would refuse it. psycopg is imported here,
    not with the module: every CLI command loads this plugin's config model (0.05-0.3 s)."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    try:
        return conninfo_to_dict(dsn)
    except ProgrammingError:
        return None  # its message may quote the DSN (and a password in it): never pass it on


def describe_dsn(dsn: str) -> str:
    """Where a DSN points, without credentials: safe for logs and error messages."""
    params = parse_dsn(dsn)
    if params is None:
        return "<invalid dsn>"
    shown = {k: params[k] for k in ("host", "hostaddr", "port", "dbname", "user") if k in params}
    return " ".join(f"{k}={v}" for k, v in shown.items()) or "<default libpq connection>"
