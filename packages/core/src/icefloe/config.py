"""One typed pipeline configuration: a TOML file plus environment overrides.

Environment overrides use ``ICEFLOE__<SECTION>__<KEY>=value`` (double underscores nest, keys
are lower-cased), so a deployment can change any key without editing the file: e.g.
``ICEFLOE__COORDINATION__BACKEND=redis``. Values stay strings and are converted by the field's
type (``"2.5"`` for a float, ``"true"`` for a bool), so a password made of digits stays a
string; a value starting with ``[`` or ``{`` that parses as a TOML array or inline table is
used as a list or table. A value that is exactly ``${env:NAME}`` or ``${file:PATH}``, in the
file or in a variable, is read from that variable or file, so secrets stay out of the pipeline
file (``icefloe show-config`` shows the reference, not the value). Hand-written because
pydantic-settings binds its TOML source at class-definition time and we want the file path
chosen at run time.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import tomllib
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from icefloe.errors import ConfigError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

ENV_PREFIX = "ICEFLOE__"
_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
# no dots: the backend's section is the TOML table [coordination.<name>]
BACKEND_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"
TABLE_NAME_RE = r"^[^.\s]+(\.[^.\s]+)+$"
# a table's target_file_size_bytes when it sets none (icefloe.commit.policy's default too)
DEFAULT_TARGET_FILE_SIZE = 128 * 1024 * 1024
# what each pattern means, for error messages (a regex is no help to a user)
_PATTERN_HELP = {
    _NAME_RE: "use letters, digits, '.', '_' and '-', starting with a letter or digit",
    BACKEND_NAME_RE: "use letters, digits, '_' and '-', starting with a letter or digit",
    TABLE_NAME_RE: 'use "namespace.table" (two or more dotted parts, no spaces)',
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceConfig(_Model):
    """Where records come from. Kafka today; ``kind`` leaves room for others."""

    kind: Literal["kafka"] = "kafka"
    bootstrap_servers: str = "127.0.0.1:9092"
    topics: list[str] = Field(default_factory=list)
    topic_pattern: str | None = None  # a regex: every topic whose whole name matches
    format: str = "json"
    format_options: dict[str, Any] = Field(default_factory=dict)
    starting_offsets: Literal["earliest", "latest", "table"] | dict[str, dict[str, int]] = (
        "earliest"
    )
    # a micro-batch has a fixed cost (planning, a JVM round, the driver's publish: ~0.7 s
    # here), so larger ones go faster; tasks still read at most spark.max_records_per_task
    max_records_per_batch: int | None = Field(default=500_000, gt=0)
    # a backlog's first micro-batch reads at most this many records, the next ones up to
    # max_records_per_batch: the first commit comes in seconds, not after the largest batch
    # (the Spark runner's source applies it)
    first_batch_records: int | None = Field(default=50_000, gt=0)
    kafka: dict[str, str] = Field(default_factory=dict)
    reader_options: dict[str, str] = Field(default_factory=dict)

    @field_validator("starting_offsets", mode="before")
    @classmethod
    def _offsets_shape(cls, value: Any) -> Any:
        # one clear message instead of one per member of the union
        if isinstance(value, str) and value not in ("earliest", "latest", "table"):
            raise ValueError(
                "use 'earliest', 'latest', 'table' or a table of offsets "
                "{topic = {partition = offset}}"
            )
        return value

    @field_validator("topic_pattern")
    @classmethod
    def _pattern_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"is not a regular expression ({exc})") from None
        return value

    @model_validator(mode="after")
    def _one_topic_selector(self) -> SourceConfig:
        if bool(self.topics) == (self.topic_pattern is not None):
            raise ValueError(
                "set exactly one of source.topics (a list of names) and source.topic_pattern "
                "(a regular expression matching whole topic names)"
            )
        return self

    def subscribed(self, names: Iterable[str]) -> list[str]:
        """The topics among ``names`` this source reads, sorted."""
        return matching_topics(names, self.topics, self.topic_pattern)


def matching_topics(names: Iterable[str], topics: Sequence[str], pattern: str | None) -> list[str]:
    """``names`` that are listed in ``topics`` or match ``pattern`` as a whole (as Spark's
    ``subscribePattern`` does); a pattern never selects internal ``__`` topics."""
    if pattern is None:
        wanted = set(topics)
        return sorted(n for n in names if n in wanted)
    regex = re.compile(pattern)
    return sorted(n for n in names if not n.startswith("__") and regex.fullmatch(n))


TableMode = Literal["append", "upsert", "cdc"]


class ChangeOptions(_Model):
    """How records change a table (docs/upsert.md): appended, upserted by key, or applied as
    change events. Shared by ``[[tables]]`` and ``[dynamic_tables]``; ``mode`` comes before
    ``id_columns`` so the check that a keyed mode has keys sees it."""

    mode: TableMode = "append"
    id_columns: list[str] = Field(default_factory=list, validate_default=True)
    cdc_op_field: str = Field(default="op", min_length=1)
    # "debezium": the row image is the record's ``after`` (``before`` for deletes)
    cdc_envelope: Literal["debezium", "none"] = "debezium"
    cdc_upsert_ops: list[str] = Field(default_factory=lambda: ["c", "r", "u"])
    cdc_delete_ops: list[str] = Field(default_factory=lambda: ["d"])

    @field_validator("id_columns")
    @classmethod
    def _keyed_mode_has_keys(cls, value: list[str], info: ValidationInfo) -> list[str]:
        mode = info.data.get("mode", "append")
        if mode != "append" and not value:
            raise ValueError(
                f'mode "{mode}" replaces rows by key: set id_columns = ["<column>", ...] '
                "to the columns that identify a row (they become the table's identifier fields)"
            )
        if len(set(value)) != len(value):
            raise ValueError("lists a column twice; list each key column once")
        return value

    @field_validator("cdc_delete_ops")
    @classmethod
    def _ops_disjoint(cls, value: list[str], info: ValidationInfo) -> list[str]:
        both = sorted(set(value) & set(info.data.get("cdc_upsert_ops") or []))
        if both:
            raise ValueError(
                f"op value(s) {both} are also in cdc_upsert_ops; put each op value in one list"
            )
        return value

    @property
    def keyed(self) -> bool:
        """Whether records replace rows by key (upsert or cdc) rather than append."""
        return self.mode != "append"

    def change_options(self) -> dict[str, Any]:
        """These options as keyword arguments, to copy them onto another entry."""
        return {name: getattr(self, name) for name in TableCommitOptions.model_fields}


class TableCommitOptions(ChangeOptions):
    """How the coordinator commits a table (``icefloe.commit.policy``): the branch it commits to,
    and whether a cycle's small files are merged first. After ``mode``, which the merge check
    reads."""

    # None: coordination.branch
    branch: str | None = Field(default=None, pattern=r"^[^\s]+$")
    merge_small_files: bool = False
    target_file_size_bytes: int = Field(default=DEFAULT_TARGET_FILE_SIZE, gt=0)
    # compaction rounds between cycles (icefloe.commit.compaction): on, and when a partition
    # needs one (any threshold passed)
    compact: bool = False
    compact_delete_ratio: float = Field(default=0.2, gt=0)
    compact_delete_files: int = Field(default=8, ge=1)
    compact_small_files: int = Field(default=16, ge=2)

    @field_validator("merge_small_files")
    @classmethod
    def _merge_only_appends(cls, value: bool, info: ValidationInfo) -> bool:
        mode = info.data.get("mode", "append")
        if value and mode != "append":
            raise ValueError(
                f'mode "{mode}" resolves keys into position deletes that name data files and '
                "row positions, which merging would change: set merge_small_files = false (or "
                'mode = "append")'
            )
        return value


class TableConfig(TableCommitOptions):
    """A target table and which records go to it (all records when no route is given)."""

    name: str = Field(pattern=TABLE_NAME_RE)
    route_field: str | None = None
    route_values: list[str] = Field(default_factory=list)
    auto_create: bool = False
    partition_by: list[str] = Field(default_factory=list)
    properties: dict[str, str] = Field(default_factory=dict)
    # a regular expression: the table also takes records whose route field matches it whole
    route_regex: str | None = None
    # schema evolution and name mapping (docs/schema.md)
    evolve_schema: bool = False
    infer_timestamps: bool = False
    rename: dict[str, str] = Field(default_factory=dict)

    @field_validator("route_regex")
    @classmethod
    def _regex_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            check_regex(value)
        return value

    @model_validator(mode="after")
    def _route_needs_field(self) -> TableConfig:
        if self.route_regex is not None and self.route_field is None:
            raise ValueError(
                f"table '{self.name}' has route_regex but no route_field: set route_field to "
                "the record field the expression is matched against"
            )
        return self


def check_regex(pattern: str) -> None:
    """ValueError unless ``pattern`` is a regular expression both Python and Arrow (RE2, which
    matches the records) accept: RE2 has no look-arounds or back-references."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        re.compile(pattern)
        pc.match_substring_regex(pa.array([""]), f"^(?:{pattern})$")
    except (re.error, pa.ArrowInvalid) as exc:
        raise ValueError(
            f"is not a regular expression records can be matched with ({exc}); use RE2 "
            "syntax (no look-arounds or back-references)"
        ) from None


class DynamicTablesConfig(TableCommitOptions):
    """Dynamic fan-out (Kafka Connect's dynamic mode): each record goes to the table its
    ``route_field`` names, prefixed with ``namespace``; the other keys apply to every such
    table as they would to a ``[[tables]]`` entry."""

    route_field: str
    namespace: str | None = Field(default=None, pattern=r"^[^\s]+$")
    auto_create: bool = False
    evolve_schema: bool = False
    infer_timestamps: bool = False
    partition_by: list[str] = Field(default_factory=list)
    properties: dict[str, str] = Field(default_factory=dict)
    rename: dict[str, str] = Field(default_factory=dict)

    def table_name(self, value: str) -> str | None:
        """The table a route value names (lower-cased, as Kafka Connect does), or None when
        it names no valid table."""
        text = value.strip().lower()
        name = f"{self.namespace}.{text}" if self.namespace else text
        return name if text and re.fullmatch(TABLE_NAME_RE, name) else None

    def table_config(self, name: str, values: Sequence[str]) -> TableConfig:
        """The table entry for ``name``: routed by the exact ``values`` that name it."""
        return TableConfig(
            name=name,
            route_field=self.route_field,
            route_values=list(values),
            auto_create=self.auto_create,
            evolve_schema=self.evolve_schema,
            infer_timestamps=self.infer_timestamps,
            partition_by=self.partition_by,
            properties=self.properties,
            rename=self.rename,
            **self.change_options(),
        )


class CatalogConfig(_Model):
    """Passed through to ``pyiceberg.catalog.load_catalog(name, **properties)``."""

    name: str = "default"
    properties: dict[str, str] = Field(default_factory=dict)


class CoordinationConfig(BaseModel):
    """Commit cadence and the backend. The backend's own keys live in a sub-table named after
    it, e.g. ``[coordination.postgres]``; they are validated by that backend's model."""

    model_config = ConfigDict(extra="allow", frozen=True)
    # unknown keys must be tables (backend sections): a misspelt scalar key is an error
    __pydantic_extra__: dict[str, dict[str, Any]] = Field(init=False)

    backend: str = Field(default="kafka", pattern=BACKEND_NAME_RE)
    commit_interval_s: float = Field(default=10.0, gt=0)
    # what the interval counts from: the previous cycle's start (Kafka Connect's
    # commit.interval) or its end (see CoordinatorSettings)
    commit_interval_from: Literal["start", "end"] = "start"
    commit_timeout_s: float = Field(default=30.0, gt=0)
    # an idle pipeline's first pending files start a cycle at once (see CoordinatorSettings)
    commit_when_idle: bool = True
    max_pending_bytes: int | None = Field(default=None, gt=0)
    max_pending_files: int | None = Field(default=None, gt=0)
    writer_timeout_s: float = Field(default=120.0, gt=0)
    lease_ttl_s: float = Field(default=10.0, gt=0)
    branch: str = "main"
    # where refused files are recorded (an Iceberg table of the pipeline's catalog) and when a
    # permanently failing table's pending files join them (see docs/reliability.md)
    quarantine_table: str = Field(default="icefloe.quarantine", pattern=TABLE_NAME_RE)
    quarantine_after_failures: int = Field(default=10, ge=1)
    table_retry_base_s: float = Field(default=1.0, gt=0)
    table_retry_max_s: float = Field(default=300.0, gt=0)
    # the channel's end moving while the coordinator's read position stands still this long
    # is reported (log, metric): see icefloe.coordination.stall
    stall_after_s: float = Field(default=120.0, gt=0)
    # the longest compaction round between two cycles (every table's partitions together)
    compaction_budget_s: float = Field(default=30.0, gt=0)
    # threads committing a cycle's tables at once (the coordinator still decides the cycle)
    commit_parallelism: int = Field(default=1, ge=1)
    # committer processes on the coordinator's machine, each with its own catalog (0: the
    # coordinator's process commits); see icefloe.coordination.processes
    commit_processes: int = Field(default=0, ge=0)

    def backend_options(self) -> dict[str, Any]:
        """The raw section of the selected backend (empty when absent)."""
        extra = self.model_extra or {}
        return dict(extra.get(self.backend, {}))


class SparkConfig(_Model):
    """The Spark side of the runner."""

    master: str = "local[2]"
    app_name: str = "icefloe"
    checkpoint_location: str | None = None
    trigger_interval_s: float = Field(default=1.0, ge=0)
    #: ``ranges``: the source hands the sink offset ranges and the sink's tasks read them
    #: (records never cross into the JVM); ``records``: Spark moves the records themselves
    data_path: Literal["ranges", "records"] = "ranges"
    #: a task has a fixed cost (~0.2 CPU s here), so ranges are split, and short ones packed,
    #: into tasks of up to this many records (docs/benchmarks.md: 50,000 -> 125,000 took the
    #: pipeline from 2.2x to 1.6x the ceiling's CPU per record)
    max_records_per_task: int | None = Field(default=125_000, gt=0)
    #: how often the driver checks its tables for a rollback to replay (docs/operations.md)
    rollback_check_interval_s: float = Field(default=10.0, gt=0)
    #: keep an archive of the driver JVM's classes (Java's AppCDS, ~150 MB in the user's
    #: cache, written by the first ``icefloe run`` as it stops) so later JVMs start in a third
    #: of the time (docs/benchmarks.md, start-up); off when the Java options manage it
    class_data_cache: bool = True
    #: Spark tasks that commit a cycle's tables on the executors (one Spark job per round of
    #: a cycle; see icefloe_spark.committers); 0: the coordinator commits in the driver
    commit_tasks: int = Field(default=0, ge=0)
    conf: dict[str, str] = Field(default_factory=dict)


ErrorPolicy = Literal["fail", "skip", "dead_letter"]


class ErrorsConfig(_Model):
    """What a writer task does with a record it cannot decode, route or convert: stop the
    pipeline (``fail``), drop it and count it (``skip``), or write it to a dead-letter table
    committed with the batch (``dead_letter``). Per record: the batch's good records are
    written either way."""

    policy: ErrorPolicy = "fail"
    dead_letter_table: str | None = Field(
        default=None, pattern=TABLE_NAME_RE, validate_default=True
    )

    @field_validator("dead_letter_table")
    @classmethod
    def _needed_for_dead_letter(cls, value: str | None, info: ValidationInfo) -> str | None:
        # a field validator (not a model one) so the error is located at this key
        if value is None and info.data.get("policy") == "dead_letter":
            raise ValueError(
                'policy "dead_letter" needs a table: set dead_letter_table = "namespace.table" '
                "(created when missing)"
            )
        return value


class PipelineConfig(_Model):
    """Everything a pipeline needs. ``name`` is the group id shared by its writers and
    coordinator; several pipelines may share one channel."""

    name: str = Field(pattern=_NAME_RE)
    source: SourceConfig
    # before ``tables``: the check that some table is configured looks at it
    dynamic_tables: DynamicTablesConfig | None = None
    tables: list[TableConfig] = Field(default_factory=list, validate_default=True)
    catalog: CatalogConfig = Field(default_factory=CatalogConfig)
    coordination: CoordinationConfig = Field(default_factory=CoordinationConfig)
    spark: SparkConfig = Field(default_factory=SparkConfig)
    # an absolute path travels with the config to every process (Spark executors get it as
    # JSON), so a backend's relative paths mean the same everywhere; set by load_config
    config_dir: str | None = None
    errors: ErrorsConfig = Field(default_factory=ErrorsConfig)
    # key path -> the ``${env:...}``/``${file:...}`` reference its value was read from, so
    # show-config shows where a secret comes from instead of the value (set by load_config)
    _references: dict[tuple[str | int, ...], str] = PrivateAttr(default_factory=dict)

    @field_validator("spark")
    @classmethod
    def _one_kind_of_committers(cls, spark: SparkConfig, info: ValidationInfo) -> SparkConfig:
        coordination = info.data.get("coordination")
        processes = coordination.commit_processes if coordination is not None else 0
        if spark.commit_tasks and processes:
            raise ValueError(
                f"spark.commit_tasks = {spark.commit_tasks} and coordination.commit_processes = "
                f"{processes} both ask for committers of a cycle's tables: keep one, set "
                "spark.commit_tasks = 0 (processes on the driver's machine) or "
                "coordination.commit_processes = 0 (Spark tasks on the executors)"
            )
        return spark

    @field_validator("errors")
    @classmethod
    def _dead_letter_not_a_target(cls, errors: ErrorsConfig, info: ValidationInfo) -> ErrorsConfig:
        targets = {t.name for t in info.data.get("tables") or []}
        if errors.dead_letter_table in targets:
            raise ValueError(
                f"errors.dead_letter_table '{errors.dead_letter_table}' is also a target table; "
                "name a table of its own for bad records"
            )
        return errors

    @field_validator("tables")
    @classmethod
    def _unique_tables(cls, tables: list[TableConfig], info: ValidationInfo) -> list[TableConfig]:
        if not tables and info.data.get("dynamic_tables") is None:
            raise ValueError(
                "no target table: list at least one [[tables]] entry, or route records to "
                "tables named by a record field with [dynamic_tables]"
            )
        seen: set[str] = set()
        for t in tables:
            if t.name in seen:
                raise ValueError(f"table '{t.name}' is listed twice; list each table once")
            seen.add(t.name)
        return tables


# --------------------------------------------------------------------------- loading


def _parse_env_value(raw: str) -> Any:
    """Strings stay strings (pydantic converts them by type); ``[...]``/``{...}`` that parse as
    TOML become lists/tables."""
    if raw[:1] in ("[", "{"):
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            pass
    return raw


def env_var_for(key: str) -> str:
    """The environment variable that overrides a dotted key."""
    return ENV_PREFIX + "__".join(key.split(".")).upper()


def apply_env(data: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``data`` with every ``ICEFLOE__A__B=value`` variable assigned at its key path.

    Shorter paths go first, so ``ICEFLOE__COORDINATION='{...}'`` replaces the whole table and
    ``ICEFLOE__COORDINATION__BACKEND`` then changes one key of it.
    """
    out: dict[str, Any] = copy.deepcopy(dict(data))
    items = []
    for var, raw in environ.items():
        if var.upper().startswith(ENV_PREFIX):
            parts = [p.lower() for p in var[len(ENV_PREFIX) :].split("__") if p]
            if parts:
                items.append((len(parts), var, parts, raw))
    for _, var, parts, raw in sorted(items):
        node = out
        for depth, p in enumerate(parts[:-1]):
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(
                    ".".join(parts[: depth + 1]),
                    f"is not a table, so {var} cannot set a key inside it",
                    f"unset {var} or make the key a table",
                    redact(nxt, p),
                )
            node = nxt
        node[parts[-1]] = _parse_env_value(raw)
    return out


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested dict built from ``ICEFLOE__A__B=value`` variables."""
    return apply_env({}, environ)


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` wins; nested tables merge key by key."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


_UNKNOWN_KEY_FIX = "remove it or check its spelling against docs/configuration.md"
_FIXES = {
    "missing": "add this key",
    "extra_forbidden": _UNKNOWN_KEY_FIX,
    "int_type": "use a whole number",
    "int_parsing": "use a whole number",
    "int_from_float": "use a whole number",
    "float_type": "use a number",
    "float_parsing": "use a number",
    "bool_type": "use true or false",
    "bool_parsing": "use true or false",
    "string_type": 'use a quoted string, e.g. "value"',
    "list_type": 'use a list, e.g. ["a", "b"]',
    "dict_type": "use a table ([section] or { key = value })",
    "model_type": "use a table ([section] or { key = value })",
    "model_attributes_type": "use a table ([section] or { key = value })",
}
# pydantic adds the member of a union that failed to the location; it is not a config key
_UNION_TAG = re.compile(r"^([a-z-]+\[.*\]|int|str|float|bool|none)$")


def _loc_key(loc: tuple[int | str, ...], prefix: str) -> str:
    parts = [str(p) for i, p in enumerate(loc) if i == 0 or not _UNION_TAG.match(str(p))]
    return prefix + ".".join(parts) or "<root>"


def _fix_for(err: ErrorDetails) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "literal_error":
        return f"use one of {ctx.get('expected', 'the allowed values')}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"use a value that is {err['msg'].removeprefix('Input should be ')}"
    if kind == "too_short":
        return f"give at least {ctx.get('min_length', 1)} item(s)"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern"))
        return _PATTERN_HELP.get(pattern, f"use a value matching {pattern}")
    if kind == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    return _FIXES.get(kind, "see docs/configuration.md")


def _problem(err: ErrorDetails) -> str:
    if err["type"] == "string_pattern_mismatch":
        return "is not in the expected form"
    return str(err["msg"])


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _keys_at(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The keys the table at ``loc`` (a validation error's location without its last part)
    takes, walking the models from ``model``; empty when it is not a model's table."""
    models = [model]
    for part in loc:
        if isinstance(part, int) or _UNION_TAG.match(part):
            continue  # a list item, or the union member pydantic names
        models = [
            m
            for model_ in models
            if part in model_.model_fields
            for m in _models_in(model_.model_fields[part].annotation)
        ]
    return sorted({key for m in models for key in m.model_fields})


def _did_you_mean(err: ErrorDetails, model: type[BaseModel] | None) -> str:
    """``did you mean 'x'? `` for an unknown key that resembles a known one, else empty."""
    if model is None or not err["loc"]:
        return ""
    *parent, key = err["loc"]
    close = difflib.get_close_matches(str(key), _keys_at(model, parent), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'? " if close else ""


def _is_unknown_backend_key(err: ErrorDetails, prefix: str) -> bool:
    loc = err["loc"]
    return (
        not prefix
        and err["type"] == "dict_type"
        and len(loc) == 2
        and loc[0] == "coordination"
        and str(loc[1]) not in CoordinationConfig.model_fields
    )


def config_error_from(
    exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None
) -> ConfigError:
    """Turn pydantic's error list into one ConfigError naming the first bad key (all keys are
    listed in the message). Bad values under secret-looking keys are masked. An unknown key
    that resembles one of ``model`` (the pipeline's, unless ``prefix`` names another table)
    gets "did you mean"."""
    if model is None and not prefix:
        model = PipelineConfig
    errs = exc.errors()
    lines = [f"{_loc_key(e['loc'], prefix)}: {_problem(e)}" for e in errs]
    first = errs[0]
    key = _loc_key(first["loc"], prefix)
    value = None if first["type"] == "missing" else redact(first.get("input"), key)
    if _is_unknown_backend_key(first, prefix):
        problem = "unknown key"
        fix = f"{_UNKNOWN_KEY_FIX}; a backend's own settings go in a table [coordination.<backend>]"
        fix = _did_you_mean(first, model) + fix
    else:
        problem, fix = _problem(first), _fix_for(first)
        if first["type"] == "extra_forbidden":
            fix = _did_you_mean(first, model) + fix
    err = ConfigError(key, problem, fix, value)
    if len(errs) > 1:
        err.args = (str(err) + "\nAll problems:\n  " + "\n  ".join(lines),)
    return err


def config_from_dict(data: Mapping[str, Any]) -> PipelineConfig:
    """Validate an already-merged mapping."""
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error_from(exc) from None


# --------------------------------------------------------------------------- references

#: a value that is exactly ``${env:NAME}`` or ``${file:PATH}`` (Kafka Connect's config-provider
#: syntax) is read from that variable or file when the configuration is loaded
_REFERENCE = re.compile(r"^\$\{(?P<kind>env|file):(?P<name>[^}]+)\}$")
KeyPath = tuple[str | int, ...]


def _dotted(path: KeyPath) -> str:
    return ".".join(str(p) for p in path)


def _read_reference(
    kind: str, name: str, path: KeyPath, environ: Mapping[str, str], base: Path
) -> str:
    key = _dotted(path)
    if kind == "env":
        if name not in environ:
            raise ConfigError(
                key,
                f"refers to environment variable {name}, which is not set",
                f"export {name} in the environment of every icefloe process, or give the value",
            )
        return environ[name]
    file = base / Path(name).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            key,
            f"refers to file {file}, which cannot be read ({reason})",
            "give the path of a readable file (a relative path starts at the pipeline "
            "file's directory)",
        ) from None
    # secret files usually end with the newline `echo` or an editor added
    return text.removesuffix("\n").removesuffix("\r")


def resolve_references(
    data: Mapping[str, Any], environ: Mapping[str, str], base: Path
) -> tuple[dict[str, Any], dict[KeyPath, str]]:
    """``data`` with every ``${env:NAME}`` / ``${file:PATH}`` value replaced by the variable's
    value or the file's text (one final newline dropped; relative paths start at ``base``),
    and the references found, by key path. Raises ConfigError naming the key."""
    found: dict[KeyPath, str] = {}

    def walk(value: Any, path: KeyPath) -> Any:
        if isinstance(value, Mapping):
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, (*path, i)) for i, v in enumerate(value)]
        match = _REFERENCE.match(value) if isinstance(value, str) else None
        if match is None:
            return value
        found[path] = value
        return _read_reference(match["kind"], match["name"].strip(), path, environ, base)

    return walk(data, ()), found


def _child(node: Any, part: str | int) -> Any:
    """``node[part]`` when ``node`` is a table with that key or a list with that index."""
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


def show_references(data: dict[str, Any], config: PipelineConfig) -> dict[str, Any]:
    """``data`` (a dump of ``config``) with each value read from a reference replaced by the
    reference itself: where a secret comes from, never the secret."""
    for path, reference in config._references.items():
        node: Any = data
        for part in path[:-1]:
            node = _child(node, part)
        if _child(node, path[-1]) is not None:
            node[path[-1]] = reference
    return data


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
        # the file's own directory, unless the file names one (relative to the file)
        data["config_dir"] = str((p.resolve().parent / data.get("config_dir", ".")).resolve())
    env = os.environ if environ is None else environ
    data = apply_env(data, env)
    if overrides:
        data = deep_merge(data, overrides)
    data, references = resolve_references(data, env, Path(data.get("config_dir") or "."))
    try:
        config = config_from_dict(data)
    except ConfigError as exc:
        shown = {_dotted(p): r for p, r in references.items()}
        if exc.key in shown:  # the value may be a secret: name where it came from instead
            raise ConfigError(
                exc.key,
                exc.problem,
                f"{exc.fix} (the value comes from {shown[exc.key]})",
                shown[exc.key],
            ) from None
        parts = exc.key.split(".")
        for n in range(len(parts), 0, -1):  # the variable may set the key or a table above it
            var = env_var_for(".".join(parts[:n]))
            if var in env:
                raise ConfigError(
                    exc.key, exc.problem, f"{exc.fix} (the value comes from {var})", exc.value
                ) from None
        raise
    config._references = references
    return config


# --------------------------------------------------------------------------- redaction

# over-masking is harmless, a missed secret is not: any key mentioning a password, secret,
# token, credential or private material, or ending in "key" (api-key, account-key, authkey)
_SECRET_KEY = re.compile(
    r"(pass(word|wd|phrase)?|secret|token|credential|private|sasl\.jaas|key$)", re.I
)
_URL_PASSWORD = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@\s]+)@", re.I
)
_KV_PASSWORD = re.compile(r"(password\s*=\s*)([^\s&;]+)", re.I)
REDACTED = "***"


def is_secret_key(key: str) -> bool:
    """Whether a configuration key (a pydantic field, a Kafka client setting, a catalog
    property) names a secret: passwords, tokens, secret/private/API keys, credentials."""
    return bool(_SECRET_KEY.search(key))


def redact(value: Any, key: str = "") -> Any:
    """A copy safe to print: values under secret-looking keys masked whatever their type,
    passwords inside URLs/DSNs masked everywhere."""
    if value is not None and is_secret_key(key):
        return REDACTED
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="python")
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, key) for v in value]
    if isinstance(value, str):
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
