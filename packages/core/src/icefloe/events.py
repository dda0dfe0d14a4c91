"""Control events: the five messages of the coordination protocol, in one envelope.

The protocol comes from Iceberg's Kafka Connect sink (StartCommit, DataWritten, DataComplete,
CommitToTable, CommitComplete). Every backend carries the same bytes, produced by
:func:`encode_event` and read back by :func:`decode_event`.

Wire format (why: a reader must resolve events written by a newer icefloe, so the writer's
schema travels with each event, as Iceberg's own Avro encoder does for its control topic)::

    b"IF" | format version (1 byte) | schema length (4 bytes, big endian) | writer schema
    (canonical JSON, zlib-compressed) | Avro binary body

Readers decode the body with the writer schema and resolve it to their own reader schema, so
fields added by newer writers are dropped and fields they lack take defaults. Every field has
a stable ``field-id`` attribute (Iceberg's own ids for the data file fields). The writer schema
is untrusted input too: it is inflated to at most 1 MiB and refused if it could make a few bytes
expand into unbounded work.
"""

from __future__ import annotations

import io
import json
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import fastavro
from fastavro.schema import parse_schema

from icefloe.errors import EventDecodeError

MAGIC = b"IF"
FORMAT_VERSION = 1
_NS = "io.icefloe.events"


class EventType(StrEnum):
    """Which of the five protocol messages an event is."""

    START_COMMIT = "START_COMMIT"
    DATA_WRITTEN = "DATA_WRITTEN"
    DATA_COMPLETE = "DATA_COMPLETE"
    COMMIT_TO_TABLE = "COMMIT_TO_TABLE"
    COMMIT_COMPLETE = "COMMIT_COMPLETE"


class FileContent(StrEnum):
    """Iceberg content type of a written file."""

    DATA = "DATA"
    POSITION_DELETES = "POSITION_DELETES"
    EQUALITY_DELETES = "EQUALITY_DELETES"


PartitionScalar = None | bool | int | float | str | bytes


@dataclass(frozen=True)
class PartitionValue:
    """One partition field's value; typed by the table's partition spec at commit time."""

    field_id: int
    name: str
    value: PartitionScalar


@dataclass(frozen=True)
class DataFileMeta:
    """Everything Iceberg needs to commit a file without opening it."""

    path: str
    record_count: int
    file_size_in_bytes: int
    file_format: str = "PARQUET"
    content: FileContent = FileContent.DATA
    spec_id: int = 0
    partition: tuple[PartitionValue, ...] = ()
    column_sizes: dict[int, int] = field(default_factory=dict)
    value_counts: dict[int, int] = field(default_factory=dict)
    null_value_counts: dict[int, int] = field(default_factory=dict)
    nan_value_counts: dict[int, int] = field(default_factory=dict)
    lower_bounds: dict[int, bytes] = field(default_factory=dict)
    upper_bounds: dict[int, bytes] = field(default_factory=dict)
    split_offsets: tuple[int, ...] | None = None
    equality_ids: tuple[int, ...] | None = None
    sort_order_id: int | None = None


@dataclass(frozen=True)
class WriterRef:
    """A writer's stable identity and the epoch of the instance that sent the event."""

    writer_id: str
    epoch: int


@dataclass(frozen=True)
class SourcePosition:
    """Where a writer stands in one source partition: next offset to read, newest record time."""

    topic: str
    partition: int
    offset: int
    max_timestamp_ms: int | None = None


@dataclass(frozen=True)
class StartCommit:
    """Coordinator → writers: finish what you have and report it for this commit."""

    commit_id: str


@dataclass(frozen=True)
class DataWritten:
    """Writer → coordinator: files written for one table."""

    table: str
    files: tuple[DataFileMeta, ...]
    commit_id: str | None = None
    table_uuid: str | None = None


@dataclass(frozen=True)
class DataComplete:
    """Writer → coordinator: all my files up to these source positions have been sent."""

    positions: tuple[SourcePosition, ...]
    commit_id: str | None = None


@dataclass(frozen=True)
class CommitToTable:
    """Coordinator → all: one table was committed (or had nothing to commit)."""

    commit_id: str
    table: str
    snapshot_id: int | None = None
    valid_through_ms: int | None = None


@dataclass(frozen=True)
class CommitComplete:
    """Coordinator → all: the commit cycle ended."""

    commit_id: str
    valid_through_ms: int | None = None


Payload = StartCommit | DataWritten | DataComplete | CommitToTable | CommitComplete

_PAYLOAD_TYPES: dict[type[Any], EventType] = {
    StartCommit: EventType.START_COMMIT,
    DataWritten: EventType.DATA_WRITTEN,
    DataComplete: EventType.DATA_COMPLETE,
    CommitToTable: EventType.COMMIT_TO_TABLE,
    CommitComplete: EventType.COMMIT_COMPLETE,
}


@dataclass(frozen=True)
class Event:
    """The envelope every control message travels in."""

    group_id: str
    payload: Payload
    writer: WriterRef | None = None
    batch_seq: int | None = None
    event_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    timestamp_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    @property
    def type(self) -> EventType:
        return _PAYLOAD_TYPES[type(self.payload)]


# --------------------------------------------------------------------------- Avro schemas


def _f(name: str, fid: int, typ: Any, default: Any = ..., doc: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "type": typ, "field-id": fid}
    if default is not ...:
        out["default"] = default
    if doc:
        out["doc"] = doc
    return out


def _opt(typ: Any) -> list[Any]:
    return ["null", typ]


_INT_LONG = {
    "type": "record",
    "name": "IntLong",
    "namespace": _NS,
    "fields": [_f("key", 1, "int"), _f("value", 2, "long")],
}
_INT_BYTES = {
    "type": "record",
    "name": "IntBytes",
    "namespace": _NS,
    "fields": [_f("key", 1, "int"), _f("value", 2, "bytes")],
}
_PARTITION_VALUE = {
    "type": "record",
    "name": "PartitionValue",
    "namespace": _NS,
    "fields": [
        _f("field_id", 1, "int"),
        _f("name", 2, "string"),
        _f("value", 3, ["null", "boolean", "long", "double", "string", "bytes"]),
    ],
}
_DATA_FILE = {
    "type": "record",
    "name": "DataFile",
    "namespace": _NS,
    "fields": [
        _f("path", 100, "string"),
        _f("file_format", 101, "string"),
        _f(
            "content",
            134,
            # no enum default on purpose: a content type this reader does not know (a newer
            # kind of delete file) must fail to decode, never be committed as data
            {"type": "enum", "name": "FileContent", "symbols": [c.value for c in FileContent]},
        ),
        _f("spec_id", 141, "int", 0),
        _f("partition", 102, {"type": "array", "items": _PARTITION_VALUE}, []),
        _f("record_count", 103, "long"),
        _f("file_size_in_bytes", 104, "long"),
        _f("column_sizes", 108, {"type": "array", "items": _INT_LONG}, []),
        _f("value_counts", 109, {"type": "array", "items": "IntLong"}, []),
        _f("null_value_counts", 110, {"type": "array", "items": "IntLong"}, []),
        _f("nan_value_counts", 137, {"type": "array", "items": "IntLong"}, []),
        _f("lower_bounds", 125, {"type": "array", "items": _INT_BYTES}, []),
        _f("upper_bounds", 128, {"type": "array", "items": "IntBytes"}, []),
        _f("split_offsets", 132, _opt({"type": "array", "items": "long"}), None),
        _f("equality_ids", 135, _opt({"type": "array", "items": "int"}), None),
        _f("sort_order_id", 140, _opt("int"), None),
    ],
}
_SOURCE_POSITION = {
    "type": "record",
    "name": "SourcePosition",
    "namespace": _NS,
    "fields": [
        _f("topic", 1, "string"),
        _f("partition", 2, "int"),
        _f("offset", 3, "long"),
        _f("max_timestamp_ms", 4, _opt("long"), None),
    ],
}
_START_COMMIT = {
    "type": "record",
    "name": "StartCommit",
    "namespace": _NS,
    "fields": [_f("commit_id", 1, "string")],
}
_DATA_WRITTEN = {
    "type": "record",
    "name": "DataWritten",
    "namespace": _NS,
    "fields": [
        _f("commit_id", 1, _opt("string"), None),
        _f("table", 2, "string"),
        _f("table_uuid", 3, _opt("string"), None),
        _f("files", 4, {"type": "array", "items": _DATA_FILE}),
    ],
}
_DATA_COMPLETE = {
    "type": "record",
    "name": "DataComplete",
    "namespace": _NS,
    "fields": [
        _f("commit_id", 1, _opt("string"), None),
        _f("positions", 2, {"type": "array", "items": _SOURCE_POSITION}),
    ],
}
_COMMIT_TO_TABLE = {
    "type": "record",
    "name": "CommitToTable",
    "namespace": _NS,
    "fields": [
        _f("commit_id", 1, "string"),
        _f("table", 2, "string"),
        _f("snapshot_id", 3, _opt("long"), None),
        _f("valid_through_ms", 4, _opt("long"), None),
    ],
}
_COMMIT_COMPLETE = {
    "type": "record",
    "name": "CommitComplete",
    "namespace": _NS,
    "fields": [
        _f("commit_id", 1, "string"),
        _f("valid_through_ms", 2, _opt("long"), None),
    ],
}

ENVELOPE_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Event",
    "namespace": _NS,
    "doc": "icefloe control event envelope",
    "fields": [
        _f("event_id", 1, "string"),
        _f(
            "type",
            2,
            {"type": "enum", "name": "EventType", "symbols": [t.value for t in EventType]},
        ),
        _f("timestamp_ms", 3, "long"),
        _f("group_id", 4, "string"),
        _f(
            "writer",
            5,
            _opt(
                {
                    "type": "record",
                    "name": "WriterRef",
                    "fields": [_f("writer_id", 1, "string"), _f("epoch", 2, "long")],
                }
            ),
            None,
        ),
        _f("batch_seq", 6, _opt("long"), None),
        _f(
            "payload",
            7,
            [_START_COMMIT, _DATA_WRITTEN, _DATA_COMPLETE, _COMMIT_TO_TABLE, _COMMIT_COMPLETE],
        ),
    ],
}

_READER = parse_schema(ENVELOPE_SCHEMA)
_WRITER_REF = f"{_NS}.WriterRef"  # the envelope's writer branch, named for fastavro's writer
_WRITER_SCHEMA_BYTES = zlib.compress(
    json.dumps(ENVELOPE_SCHEMA, separators=(",", ":"), sort_keys=True).encode(), 9
)
_HEADER = MAGIC + bytes([FORMAT_VERSION]) + struct.pack(">I", len(_WRITER_SCHEMA_BYTES))
_MAX_SCHEMA_BYTES = 1 << 20
_SCHEMA_CACHE: OrderedDict[bytes, Any] = OrderedDict()
_SCHEMA_CACHE_SIZE = 32
_SCHEMA_CACHE_LOCK = threading.Lock()


# --------------------------------------------------------------------------- to and from dicts


def _pairs(d: dict[int, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": v} for k, v in sorted(d.items())]


def _file_to_dict(f: DataFileMeta) -> dict[str, Any]:
    return {
        "path": f.path,
        "file_format": f.file_format,
        "content": f.content.value,
        "spec_id": f.spec_id,
        "partition": [
            {"field_id": p.field_id, "name": p.name, "value": p.value} for p in f.partition
        ],
        "record_count": f.record_count,
        "file_size_in_bytes": f.file_size_in_bytes,
        "column_sizes": _pairs(f.column_sizes),
        "value_counts": _pairs(f.value_counts),
        "null_value_counts": _pairs(f.null_value_counts),
        "nan_value_counts": _pairs(f.nan_value_counts),
        "lower_bounds": _pairs(f.lower_bounds),
        "upper_bounds": _pairs(f.upper_bounds),
        "split_offsets": None if f.split_offsets is None else list(f.split_offsets),
        "equality_ids": None if f.equality_ids is None else list(f.equality_ids),
        "sort_order_id": f.sort_order_id,
    }


def _file_from_dict(d: dict[str, Any]) -> DataFileMeta:
    def m(key: str) -> dict[int, Any]:
        return {p["key"]: p["value"] for p in d[key]}

    return DataFileMeta(
        path=d["path"],
        file_format=d["file_format"],
        content=FileContent(d["content"]),
        spec_id=d["spec_id"],
        partition=tuple(
            PartitionValue(p["field_id"], p["name"], p["value"]) for p in d["partition"]
        ),
        record_count=d["record_count"],
        file_size_in_bytes=d["file_size_in_bytes"],
        column_sizes=m("column_sizes"),
        value_counts=m("value_counts"),
        null_value_counts=m("null_value_counts"),
        nan_value_counts=m("nan_value_counts"),
        lower_bounds=m("lower_bounds"),
        upper_bounds=m("upper_bounds"),
        split_offsets=None if d["split_offsets"] is None else tuple(d["split_offsets"]),
        equality_ids=None if d["equality_ids"] is None else tuple(d["equality_ids"]),
        sort_order_id=d["sort_order_id"],
    )


def _payload_to_dict(p: Payload) -> tuple[str, dict[str, Any]]:
    """The payload as fastavro's union tuple (branch name, record): named, the writer takes
    that branch without first validating the whole record against each branch, which was
    about half of encoding a DataWritten; the bytes are the same."""
    name = f"{_NS}.{type(p).__name__}"
    body: dict[str, Any]
    if isinstance(p, StartCommit):
        body = {"commit_id": p.commit_id}
    elif isinstance(p, DataWritten):
        body = {
            "commit_id": p.commit_id,
            "table": p.table,
            "table_uuid": p.table_uuid,
            "files": [_file_to_dict(f) for f in p.files],
        }
    elif isinstance(p, DataComplete):
        body = {
            "commit_id": p.commit_id,
            "positions": [
                {
                    "topic": s.topic,
                    "partition": s.partition,
                    "offset": s.offset,
                    "max_timestamp_ms": s.max_timestamp_ms,
                }
                for s in p.positions
            ],
        }
    elif isinstance(p, CommitToTable):
        body = {
            "commit_id": p.commit_id,
            "table": p.table,
            "snapshot_id": p.snapshot_id,
            "valid_through_ms": p.valid_through_ms,
        }
    else:
        body = {"commit_id": p.commit_id, "valid_through_ms": p.valid_through_ms}
    return name, body


def _payload_from(name: str, d: dict[str, Any]) -> Payload:
    short = name.rsplit(".", 1)[-1]
    if short == "StartCommit":
        return StartCommit(commit_id=d["commit_id"])
    if short == "DataWritten":
        return DataWritten(
            table=d["table"],
            files=tuple(_file_from_dict(f) for f in d["files"]),
            commit_id=d["commit_id"],
            table_uuid=d["table_uuid"],
        )
    if short == "DataComplete":
        return DataComplete(
            positions=tuple(SourcePosition(**s) for s in d["positions"]),
            commit_id=d["commit_id"],
        )
    if short == "CommitToTable":
        return CommitToTable(**d)
    if short == "CommitComplete":
        return CommitComplete(**d)
    raise EventDecodeError(f"unknown payload type {name!r}")


# --------------------------------------------------------------------------- codec


def encode_event(event: Event) -> bytes:
    """Serialize an event to its wire bytes (header, writer schema, Avro body)."""
    record = {
        "event_id": event.event_id,
        "type": event.type.value,
        "timestamp_ms": event.timestamp_ms,
        "group_id": event.group_id,
        "writer": None
        if event.writer is None
        else (_WRITER_REF, {"writer_id": event.writer.writer_id, "epoch": event.writer.epoch}),
        "batch_seq": event.batch_seq,
        "payload": _payload_to_dict(event.payload),
    }
    buf = io.BytesIO()
    buf.write(_HEADER)
    buf.write(_WRITER_SCHEMA_BYTES)
    fastavro.schemaless_writer(buf, _READER, record)
    return buf.getvalue()


def _zero_width(schema: Any, named: dict[str, Any], seen: frozenset[str] = frozenset()) -> bool:
    """True when values of ``schema`` may be encoded in zero bytes."""
    if isinstance(schema, str):
        if schema == "null":
            return True
        if schema in named and schema not in seen:
            return _zero_width(named[schema], named, seen | {schema})
        return False
    if isinstance(schema, dict):
        kind = schema.get("type")
        if kind == "fixed":
            return bool(schema.get("size") == 0)
        if kind == "record":
            name = str(schema.get("name"))
            inner = seen | {name}
            return all(_zero_width(f["type"], named, inner) for f in schema.get("fields", []))
        if kind in ("array", "map", "enum"):
            return False
        return _zero_width(kind, named, seen)
    return False  # a union always carries its branch index


def _check_bounded(schema: Any, named: dict[str, Any]) -> None:
    """Refuse writer schemas whose arrays hold zero-width items: an array block count is read
    from the data, so such an array lets a few bytes demand billions of empty items (a hang)."""
    stack = [schema]
    visited: set[int] = set()
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict) and id(node) not in visited:
            visited.add(id(node))
            kind = node.get("type")
            if kind == "array":
                if _zero_width(node.get("items"), named):
                    raise EventDecodeError("writer schema has an array of zero-width items")
                stack.append(node.get("items"))
            elif kind == "map":
                stack.append(node.get("values"))
            elif kind == "record":
                stack.extend(f.get("type") for f in node.get("fields", []))
            else:
                stack.append(kind)


def _writer_schema(raw: bytes) -> Any:
    if raw == _WRITER_SCHEMA_BYTES:
        return _READER
    with _SCHEMA_CACHE_LOCK:
        cached = _SCHEMA_CACHE.get(raw)
        if cached is not None:
            _SCHEMA_CACHE.move_to_end(raw)
            return cached
    inflater = zlib.decompressobj()
    text = inflater.decompress(raw, _MAX_SCHEMA_BYTES)
    if inflater.unconsumed_tail:
        raise EventDecodeError(f"writer schema is larger than {_MAX_SCHEMA_BYTES} bytes")
    if not inflater.eof or inflater.unused_data:
        raise EventDecodeError("writer schema is not one complete zlib stream")
    named: dict[str, Any] = {}
    parsed = parse_schema(json.loads(text), named)
    _check_bounded(parsed, named)
    with _SCHEMA_CACHE_LOCK:  # writers' responder threads decode concurrently
        _SCHEMA_CACHE[raw] = parsed
        if len(_SCHEMA_CACHE) > _SCHEMA_CACHE_SIZE:
            _SCHEMA_CACHE.popitem(last=False)
    return parsed


def decode_event(data: bytes) -> Event:
    """Decode wire bytes into an :class:`Event`.

    Raises :class:`EventDecodeError` and nothing else for any input, because the bytes come
    from a shared channel that any client may write to.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise EventDecodeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < 7 or data[:2] != MAGIC:
        raise EventDecodeError("not an icefloe control event (bad magic)")
    if data[2] != FORMAT_VERSION:
        raise EventDecodeError(
            f"unsupported event format version {data[2]} (this icefloe reads {FORMAT_VERSION})"
        )
    (schema_len,) = struct.unpack(">I", data[3:7])
    if schema_len > _MAX_SCHEMA_BYTES or 7 + schema_len > len(data):
        raise EventDecodeError("truncated event (schema length exceeds data)")
    try:
        writer = _writer_schema(data[7 : 7 + schema_len])
        body = io.BytesIO(data[7 + schema_len :])
        rec = fastavro.schemaless_reader(
            body, writer, _READER, return_record_name=True, return_record_name_override=True
        )
        if body.tell() != len(data) - 7 - schema_len:
            raise EventDecodeError("trailing bytes after event body")
        if not isinstance(rec, dict):
            raise EventDecodeError("event body is not a record")
        pname, pbody = rec["payload"]
        payload = _payload_from(pname, pbody)
        w = rec["writer"]
        event = Event(
            group_id=rec["group_id"],
            payload=payload,
            writer=None if w is None else WriterRef(w["writer_id"], w["epoch"]),
            batch_seq=rec["batch_seq"],
            event_id=rec["event_id"],
            timestamp_ms=rec["timestamp_ms"],
        )
        if event.type.value != rec["type"]:
            raise EventDecodeError(f"type {rec['type']} does not match payload {pname}")
        return event
    except EventDecodeError:
        raise
    except Exception as exc:  # untrusted input: any failure below is a decode failure
        raise EventDecodeError(f"malformed control event: {type(exc).__name__}: {exc}") from exc
