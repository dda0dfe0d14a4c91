"""Avro records (binary encoding, one record per Kafka value) with a known writer schema.

Options (``source.format_options``):

* ``schema_file``: path of the writer schema (``.avsc`` JSON; relative to the pipeline file,
  and inlined as ``schema`` before the config reaches executors: see ``inline_schema_file``), or
* ``schema``: the writer schema inline (JSON text or a TOML table);
* ``wire_format``: ``"raw"`` (default) or ``"confluent"`` (each value starts with a zero magic
  byte and a 4-byte schema id, as Confluent's serializers write);
* ``schema_id``: with ``confluent``, the only schema id accepted (others are an error naming
  the record, since this codec holds a single writer schema).

Decoding is per record: fastavro has no batch decoder for schemaless values, and Avro's
variable-length encoding cannot be parsed column-wise. The decoded rows become Arrow columns of
the Avro schema's own types in one ``Table.from_pylist``; conversion to the table schema
(names, aliases, casts) is the converter's job. A null value decodes to a row of nulls.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa

from icefloe.errors import ConfigError, record_error
from icefloe.hookspecs import DecodeContext

_PRIMITIVES = {
    "null": pa.null(),
    "boolean": pa.bool_(),
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "bytes": pa.binary(),
    "string": pa.string(),
}
_LOGICAL = {
    "date": pa.date32(),
    "time-millis": pa.time32("ms"),
    "time-micros": pa.time64("us"),
    "timestamp-millis": pa.timestamp("ms", "UTC"),
    "timestamp-micros": pa.timestamp("us", "UTC"),
    "local-timestamp-millis": pa.timestamp("ms"),
    "local-timestamp-micros": pa.timestamp("us"),
    "uuid": pa.uuid(),
}
_KEY = "source.format_options"


def arrow_type(schema: Any, named: dict[str, pa.DataType] | None = None) -> pa.DataType:
    """The Arrow type fastavro's decoded values of a (parsed) Avro ``schema`` fit."""
    named = {} if named is None else named
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return _PRIMITIVES[schema]
        if schema in named:
            return named[schema]
        raise ConfigError(f"{_KEY}.schema", f"unknown Avro type '{schema}'", "fix the schema")
    if isinstance(schema, list):
        branches = [s for s in schema if s != "null"]
        if len(branches) != 1:
            raise ConfigError(
                f"{_KEY}.schema",
                f"union {schema} has several non-null branches, which a table column cannot hold",
                "use a union of null and one type",
            )
        return arrow_type(branches[0], named)
    logical = schema.get("logicalType")
    if logical == "decimal":
        return pa.decimal128(int(schema["precision"]), int(schema.get("scale", 0)))
    if logical in _LOGICAL:
        return _LOGICAL[logical]
    kind = schema["type"]
    out: pa.DataType
    if kind == "record":
        out = pa.struct(
            [pa.field(f["name"], arrow_type(f["type"], named)) for f in schema["fields"]]
        )
    elif kind == "enum":
        out = pa.string()
    elif kind == "array":
        out = pa.list_(arrow_type(schema["items"], named))
    elif kind == "map":
        out = pa.map_(pa.string(), arrow_type(schema["values"], named))
    elif kind == "fixed":
        out = pa.binary(int(schema["size"]))
    else:
        out = arrow_type(kind, named)
    if "name" in schema and kind in ("record", "enum", "fixed"):
        named[schema["name"]] = out
    return out


def inline_schema_file(options: Mapping[str, Any], base_dir: Path | None) -> dict[str, Any]:
    """``options`` with ``schema_file`` replaced by ``schema``: the file's text, read here.

    The codec is built wherever records are decoded, on a cluster in executors that work in
    their worker's directory and may not have the file at all; reading it once where the
    pipeline starts and shipping the text makes the options self-contained. A relative path is
    taken against ``base_dir`` (the pipeline file's directory), as backends' paths are.
    """
    out = dict(options)
    file = out.pop("schema_file", None)
    if file is None or "schema" in out:
        return dict(options)  # nothing to inline, or both given: the codec names the error
    path = Path(file)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        out["schema"] = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"{_KEY}.schema_file", f"cannot read it ({exc})", "give a readable path", str(path)
        ) from None
    return out


def _load_schema(options: dict[str, Any]) -> Any:
    file, inline = options.pop("schema_file", None), options.pop("schema", None)
    if (file is None) == (inline is None):
        raise ConfigError(
            f"{_KEY}.schema_file",
            "the avro format needs exactly one of schema_file and schema",
            'set schema_file = "path/to/value.avsc" (or schema = an inline Avro schema)',
        )
    if file is not None:
        try:
            text = Path(file).read_text()
        except OSError as exc:
            raise ConfigError(
                f"{_KEY}.schema_file", f"cannot read it ({exc})", "give a readable path", file
            ) from None
    else:
        text = inline if isinstance(inline, str) else json.dumps(inline)
    try:
        return fastavro.parse_schema(json.loads(text))
    except (ValueError, fastavro.schema.SchemaParseException) as exc:
        key = f"{_KEY}.{'schema_file' if file is not None else 'schema'}"
        raise ConfigError(key, f"not a valid Avro schema ({exc})", "fix the schema") from None


class AvroCodec:
    """``format = "avro"``."""

    def __init__(self, options: dict[str, Any]) -> None:
        opts = dict(options)
        self.schema = _load_schema(opts)
        self.wire_format = opts.pop("wire_format", "raw")
        if self.wire_format not in ("raw", "confluent"):
            raise ConfigError(
                f"{_KEY}.wire_format",
                "must be 'raw' or 'confluent'",
                'set wire_format = "confluent" for Confluent-serialized values',
                self.wire_format,
            )
        self.schema_id: int | None = opts.pop("schema_id", None)
        if opts:
            raise ConfigError(
                f"{_KEY}.{sorted(opts)[0]}",
                "is not an option of the avro format",
                "remove it (avro knows: schema_file, schema, wire_format, schema_id)",
            )
        top = arrow_type(self.schema)
        # a non-record schema decodes into one column called "value"
        self.is_record = pa.types.is_struct(top)
        self.arrow_schema = pa.schema(list(top)) if self.is_record else pa.schema([("value", top)])

    def _payload(self, raw: bytes, row: int, context: DecodeContext) -> bytes:
        if self.wire_format == "raw":
            return raw
        if len(raw) < 5 or raw[0] != 0:
            raise record_error(context, row, None, "no Confluent wire-format header")
        schema_id = int.from_bytes(raw[1:5], "big")
        if self.schema_id is not None and schema_id != self.schema_id:
            raise record_error(
                context, row, None, f"schema id {schema_id}, expected {self.schema_id}"
            )
        return raw[5:]

    def decode(self, values: pa.Array, schema: pa.Schema, context: DecodeContext) -> pa.Table:
        rows: list[dict[str, Any]] = []
        for row, raw in enumerate(values.to_pylist()):
            if raw is None:
                rows.append({})
                continue
            buf = io.BytesIO(self._payload(raw, row, context))
            try:
                rec = fastavro.schemaless_reader(buf, self.schema, None)
            except Exception as exc:  # fastavro raises many types on corrupt input
                raise record_error(context, row, None, f"not valid Avro: {exc!r}") from None
            if buf.tell() != len(buf.getbuffer()):
                raise record_error(
                    context, row, None, "not valid Avro for the schema: trailing bytes"
                )
            rows.append(rec if isinstance(rec, dict) and self.is_record else {"value": rec})
        return pa.Table.from_pylist(rows, schema=self.arrow_schema)
