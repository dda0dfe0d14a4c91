"""One typed pipeline configuration: a TOML file plus environment overrides.

Environment overrides use ``ICEFLOE__<SECTION>__<KEY>=value`` (double underscores nest, keys
are lower-cased, values are parsed as TOML scalars when they parse, else taken as strings), so
a deployment can change any key without editing the file: e.g.
``ICEFLOE__COORDINATION__BACKEND=redis``. Hand-written because pydantic-settings binds its TOML
source at class-definition time and we want the file path chosen at run time.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from icefloe.errors import ConfigError

ENV_PREFIX = "ICEFLOE__"
_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceConfig(_Model):
    """Where records come from. Kafka today; ``kind`` leaves room for others."""

    kind: Literal["kafka"] = "kafka"
    bootstrap_servers: str = "127.0.0.1:9092"
    topics: list[str] = Field(min_length=1)
    format: str = "json"
    format_options: dict[str, Any] = Field(default_factory=dict)
    starting_offsets: Literal["earliest", "latest", "table"] | dict[str, dict[str, int]] = (
        "earliest"
    )
    max_records_per_batch: int | None = Field(default=100_000, gt=0)
    kafka: dict[str, str] = Field(default_factory=dict)


class TableConfig(_Model):
    """A target table and which records go to it (all records when no route is given)."""

    name: str = Field(pattern=r"^[^.\s]+(\.[^.\s]+)+$")
    route_field: str | None = None
    route_values: list[str] = Field(default_factory=list)
    auto_create: bool = False
    partition_by: list[str] = Field(default_factory=list)
    id_columns: list[str] = Field(default_factory=list)


class CatalogConfig(_Model):
    """Passed through to ``pyiceberg.catalog.load_catalog(name, **properties)``."""

    name: str = "default"
    properties: dict[str, str] = Field(default_factory=dict)


class CoordinationConfig(BaseModel):
    """Commit cadence and the backend. The backend's own keys live in a sub-table named after
    it, e.g. ``[coordination.postgres]``; they are validated by that backend's model."""

    model_config = ConfigDict(extra="allow", frozen=True)

    backend: str = "kafka"
    commit_interval_s: float = Field(default=10.0, gt=0)
    commit_timeout_s: float = Field(default=30.0, gt=0)
    max_pending_bytes: int | None = Field(default=None, gt=0)
    max_pending_files: int | None = Field(default=None, gt=0)
    writer_timeout_s: float = Field(default=120.0, gt=0)
    lease_ttl_s: float = Field(default=10.0, gt=0)
    branch: str = "main"

    def backend_options(self) -> dict[str, Any]:
        """The raw section of the selected backend (empty when absent)."""
        extra = self.model_extra or {}
        section = extra.get(self.backend, {})
        if not isinstance(section, dict):
            raise ConfigError(
                f"coordination.{self.backend}",
                "must be a table of backend settings",
                f"write it as [coordination.{self.backend}] with key = value lines",
                section,
            )
        return dict(section)


class SparkConfig(_Model):
    """The Spark side of the runner."""

    master: str = "local[2]"
    app_name: str = "icefloe"
    checkpoint_location: str | None = None
    trigger_interval_s: float = Field(default=1.0, ge=0)
    conf: dict[str, str] = Field(default_factory=dict)


class PipelineConfig(_Model):
    """Everything a pipeline needs. ``name`` is the group id shared by its writers and
    coordinator; several pipelines may share one channel."""

    name: str = Field(pattern=_NAME_RE)
    source: SourceConfig
    tables: list[TableConfig] = Field(min_length=1)
    catalog: CatalogConfig = Field(default_factory=CatalogConfig)
    coordination: CoordinationConfig = Field(default_factory=CoordinationConfig)
    spark: SparkConfig = Field(default_factory=SparkConfig)

    @field_validator("tables")
    @classmethod
    def _unique_tables(cls, tables: list[TableConfig]) -> list[TableConfig]:
        seen: set[str] = set()
        for t in tables:
            if t.name in seen:
                raise ValueError(f"table '{t.name}' is listed twice; list each table once")
            seen.add(t.name)
        return tables


# --------------------------------------------------------------------------- loading


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested dict built from ``ICEFLOE__A__B=value`` variables."""
    out: dict[str, Any] = {}
    for key, raw in sorted(environ.items()):
        if not key.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in key[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(
                    ".".join(parts), "conflicts with a scalar override", f"unset {key}", raw
                )
            node = nxt
        node[parts[-1]] = _parse_env_value(raw)
    return out


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` wins; nested tables merge key by key."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _fix_for(err: Mapping[str, Any]) -> str:
    kind = str(err.get("type", ""))
    if kind == "missing":
        return "add this key"
    if kind == "extra_forbidden":
        return "remove it or check its spelling against docs/configuration.md"
    if kind.startswith("literal_error") or kind == "enum":
        return str(err.get("msg", "use one of the allowed values"))
    return str(err.get("msg", "see docs/configuration.md"))


def config_error_from(exc: ValidationError, prefix: str = "") -> ConfigError:
    """Turn pydantic's error list into one ConfigError naming the first bad key (all keys are
    listed in the message)."""
    errs = exc.errors()
    lines = []
    for e in errs:
        key = prefix + ".".join(str(p) for p in e["loc"])
        lines.append(f"{key}: {e['msg']}")
    first = errs[0]
    key = prefix + ".".join(str(p) for p in first["loc"]) or "<root>"
    value = None if first["type"] == "missing" else first.get("input")
    err = ConfigError(key, str(first["msg"]), _fix_for(first), value)
    if len(errs) > 1:
        err.args = (str(err) + "\nAll problems:\n  " + "\n  ".join(lines),)
    return err


def config_from_dict(data: Mapping[str, Any]) -> PipelineConfig:
    """Validate an already-merged mapping."""
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error_from(exc) from None


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PipelineConfig:
    """Read the TOML file (if any), apply environment then explicit overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(
                "--config", "file not found", "pass the path of a pipeline TOML file", str(p)
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(
                "--config", f"not valid TOML ({exc})", "fix the syntax", str(p)
            ) from None
    data = deep_merge(data, env_overrides(os.environ if environ is None else environ))
    if overrides:
        data = deep_merge(data, overrides)
    return config_from_dict(data)


# --------------------------------------------------------------------------- redaction

_SECRET_KEY = re.compile(
    r"(pass(word)?|secret|token|credential|private|api[._-]?key|sasl\.jaas)", re.I
)
_URL_PASSWORD = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@", re.I
)
_KV_PASSWORD = re.compile(r"(password\s*=\s*)(\S+)", re.I)
REDACTED = "***"


def redact(value: Any, key: str = "") -> Any:
    """A copy safe to print: secret-looking keys masked, passwords inside URLs/DSNs masked."""
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    if isinstance(value, str):
        if _SECRET_KEY.search(key):
            return REDACTED
        masked = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", value)
        return _KV_PASSWORD.sub(lambda m: f"{m.group(1)}{REDACTED}", masked)
    if hasattr(value, "get_secret_value"):
        return REDACTED
    return value


def redacted_dict(config: BaseModel) -> dict[str, Any]:
    """The configuration as a plain dict with secrets masked (for `icefloe show-config`)."""
    data = redact(config.model_dump(mode="python"))
    assert isinstance(data, dict)
    return data
