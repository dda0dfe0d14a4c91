"""Control events: round trips, the pinned wire format, newer writers, and hostile bytes.

Golden files pin the wire format: regenerate them only for an intended format change, with
``python packages/core/tests/icefloe/test_events.py --update-golden``, and say so in review.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icefloe.errors import EventDecodeError
from icefloe.events import (
    ENVELOPE_SCHEMA,
    FORMAT_VERSION,
    MAGIC,
    CommitComplete,
    CommitToTable,
    DataComplete,
    DataFileMeta,
    DataWritten,
    Event,
    EventType,
    FileContent,
    PartitionValue,
    SourcePosition,
    StartCommit,
    WriterRef,
    decode_event,
    encode_event,
)

GOLDEN = Path(__file__).parent / "golden"
EVENT_ID = "5f0c6d3e-9a51-4c2b-8f7e-0d1c2b3a4f5e"
TS = 1_700_000_000_123
COMMIT = "0b9e8a36-2f04-4d4b-9c55-6a0e6f0f5a11"
WRITER = WriterRef("query-7f3a/part-0", 3)

FULL_FILE = DataFileMeta(
    path="file:///warehouse/db/orders/data/region=eu/day=19700/00000-0-a.parquet",
    record_count=1234,
    file_size_in_bytes=56_789,
    file_format="PARQUET",
    content=FileContent.DATA,
    spec_id=2,
    partition=(
        PartitionValue(1000, "region", "eu"),
        PartitionValue(1001, "day", 19_700),
        PartitionValue(1002, "flag", True),
        PartitionValue(1003, "ratio", 0.25),
        PartitionValue(1004, "id_bucket", b"\x00\xff\x10"),
        PartitionValue(1005, "missing", None),
        PartitionValue(1006, "big", -(2**62)),
    ),
    column_sizes={1: 100, 2: 200, 3: 300},
    value_counts={1: 1234, 2: 1234, 3: 1234},
    null_value_counts={1: 0, 2: 5, 3: 0},
    nan_value_counts={3: 2},
    lower_bounds={1: b"\x01\x00\x00\x00", 2: b"apple", 3: b""},
    upper_bounds={1: b"\xff\x00\x00\x00", 2: b"zebra", 3: b"\x00"},
    split_offsets=(4, 40_000),
    equality_ids=None,
    sort_order_id=1,
)
DELETE_FILE = DataFileMeta(
    path="file:///warehouse/db/orders/data/00001-1-eq.parquet",
    record_count=7,
    file_size_in_bytes=999,
    content=FileContent.EQUALITY_DELETES,
    equality_ids=(1, 2),
)
POSITION_DELETE_FILE = DataFileMeta(
    path="file:///warehouse/db/orders/data/00002-1-pos.parquet",
    record_count=3,
    file_size_in_bytes=512,
    content=FileContent.POSITION_DELETES,
    split_offsets=(),
    equality_ids=(),
)
MINIMAL_FILE = DataFileMeta(path="s3://b/t/f.parquet", record_count=1, file_size_in_bytes=1)


def _event(payload: Any, **kw: Any) -> Event:
    return Event(
        group_id="orders-pipeline", payload=payload, event_id=EVENT_ID, timestamp_ms=TS, **kw
    )


# name -> event; every type fully populated, then with optional fields left out
EVENTS: dict[str, Event] = {
    "start_commit": _event(StartCommit(COMMIT)),
    "data_written": _event(
        DataWritten(
            table="db.orders",
            files=(FULL_FILE, DELETE_FILE, POSITION_DELETE_FILE),
            commit_id=COMMIT,
            table_uuid="9d5d6f8e-1c3b-4f7a-a2e4-3b5c6d7e8f90",
        ),
        writer=WRITER,
        batch_seq=41,
    ),
    "data_written_minimal": _event(DataWritten(table="db.t", files=(MINIMAL_FILE,))),
    "data_written_no_files": _event(
        DataWritten(table="db.t", files=()), writer=WRITER, batch_seq=0
    ),
    "data_complete": _event(
        DataComplete(
            positions=(
                SourcePosition("orders", 0, 1500, 1_700_000_000_000),
                SourcePosition("orders", 1, 0, None),
                SourcePosition("payments", 7, 2**40, -1),
            ),
            commit_id=COMMIT,
        ),
        writer=WRITER,
        batch_seq=41,
    ),
    "data_complete_minimal": _event(DataComplete(positions=())),
    "commit_to_table": _event(
        CommitToTable(
            COMMIT, "db.orders", snapshot_id=8_765_432_109_876_543_210 % 2**63, valid_through_ms=TS
        )
    ),
    "commit_to_table_minimal": _event(CommitToTable(COMMIT, "db.orders")),
    "commit_complete": _event(CommitComplete(COMMIT, valid_through_ms=TS - 5000)),
    "commit_complete_minimal": _event(CommitComplete(COMMIT)),
}


def _split(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(header, compressed writer schema, Avro body) of wire bytes."""
    (n,) = struct.unpack(">I", data[3:7])
    return data[:7], data[7 : 7 + n], data[7 + n :]


def _frame(schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    """Wire bytes built by hand from the documented layout, for a writer with ``schema``."""
    raw = zlib.compress(json.dumps(schema).encode())
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(schema), record)
    return MAGIC + bytes([FORMAT_VERSION]) + struct.pack(">I", len(raw)) + raw + body.getvalue()


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_round_trip(name: str) -> None:
    event = EVENTS[name]
    decoded = decode_event(encode_event(event))
    assert decoded == event
    assert decoded.type == event.type


def test_every_event_type_is_covered() -> None:
    assert {e.type for e in EVENTS.values()} == set(EventType)


def test_partition_values_keep_their_scalar_kind() -> None:
    decoded = decode_event(encode_event(EVENTS["data_written"]))
    assert isinstance(decoded.payload, DataWritten)
    got = [(p.name, type(p.value)) for p in decoded.payload.files[0].partition]
    assert got == [(p.name, type(p.value)) for p in FULL_FILE.partition]
    assert {t for _, t in got} == {str, int, bool, float, bytes, type(None)}


def test_nan_partition_value_survives() -> None:
    f = DataFileMeta("p", 1, 1, partition=(PartitionValue(1, "x", math.nan),))
    decoded = decode_event(encode_event(_event(DataWritten("db.t", (f,)))))
    assert isinstance(decoded.payload, DataWritten)
    value = decoded.payload.files[0].partition[0].value
    assert isinstance(value, float)
    assert math.isnan(value)


def test_default_event_id_and_timestamp_are_fresh() -> None:
    a, b = Event("g", StartCommit("c")), Event("g", StartCommit("c"))
    assert a.event_id != b.event_id
    assert a.timestamp_ms > 1_600_000_000_000
    assert decode_event(encode_event(a)) == a


def test_decode_accepts_bytearray_and_memoryview() -> None:
    data = encode_event(EVENTS["start_commit"])
    # annotated `bytes`; any buffer is read the same
    assert decode_event(bytearray(data)) == EVENTS["start_commit"]  # type: ignore[arg-type]
    assert decode_event(memoryview(data)) == EVENTS["start_commit"]  # type: ignore[arg-type]


# --------------------------------------------------------------------------- golden bytes


def _golden_path(name: str) -> Path:
    return GOLDEN / f"{name}.bin"


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_encoding_matches_golden_bytes(name: str) -> None:
    golden = _golden_path(name).read_bytes()
    data = encode_event(EVENTS[name])
    got_header, got_schema, got_body = _split(data)
    want_header, want_schema, want_body = _split(golden)
    assert got_header[:3] == want_header[:3] == MAGIC + bytes([FORMAT_VERSION])
    assert zlib.decompress(got_schema) == zlib.decompress(want_schema), "writer schema changed"
    assert got_body == want_body, "Avro body changed"
    assert data == golden


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_golden_bytes_decode_to_the_event(name: str) -> None:
    assert decode_event(_golden_path(name).read_bytes()) == EVENTS[name]


def test_golden_schema_carries_stable_field_ids() -> None:
    _, schema, _ = _split(_golden_path("data_written").read_bytes())
    envelope = json.loads(zlib.decompress(schema))
    assert [(f["name"], f["field-id"]) for f in envelope["fields"]] == [
        ("event_id", 1),
        ("type", 2),
        ("timestamp_ms", 3),
        ("group_id", 4),
        ("writer", 5),
        ("batch_seq", 6),
        ("payload", 7),
    ]
    data_written = next(t for t in envelope["fields"][6]["type"] if t["name"] == "DataWritten")
    data_file = data_written["fields"][3]["type"]["items"]
    ids = {f["name"]: f["field-id"] for f in data_file["fields"]}
    # Iceberg's own field ids for the data_file struct
    assert ids["path"] == 100
    assert ids["record_count"] == 103
    assert ids["lower_bounds"] == 125
    assert ids["equality_ids"] == 135


def update_golden() -> None:
    """Write the golden files from EVENTS (only for an intended wire-format change)."""
    GOLDEN.mkdir(exist_ok=True)
    for name, event in EVENTS.items():
        _golden_path(name).write_bytes(encode_event(event))
        print(f"wrote {_golden_path(name)}")


# --------------------------------------------------------------------------- newer writers


def _extended_schema() -> dict[str, Any]:
    """What a newer icefloe might write: a new envelope field, a new DataFile field, a new
    payload type and a new file content kind."""
    schema = copy.deepcopy(ENVELOPE_SCHEMA)
    schema["fields"].insert(4, {"name": "trace_id", "type": "string", "default": "", "field-id": 8})
    payloads = schema["fields"][-1]["type"]
    payloads.append(
        {
            "type": "record",
            "name": "Heartbeat",
            "fields": [{"name": "load", "type": "double", "field-id": 1}],
        }
    )
    data_written = next(p for p in payloads if p["name"] == "DataWritten")
    data_file = data_written["fields"][3]["type"]["items"]
    data_file["fields"].append(
        {"name": "key_metadata", "type": ["null", "bytes"], "default": None, "field-id": 131}
    )
    content = next(f for f in data_file["fields"] if f["name"] == "content")
    content["type"]["symbols"].append("DELETION_VECTOR")
    return schema


def _file_record(**extra: Any) -> dict[str, Any]:
    return {
        "path": "s3://b/t/f.parquet",
        "file_format": "PARQUET",
        "content": "DATA",
        "spec_id": 0,
        "partition": [{"field_id": 1000, "name": "day", "value": 19_700}],
        "record_count": 10,
        "file_size_in_bytes": 100,
        "column_sizes": [{"key": 1, "value": 40}],
        "value_counts": [],
        "null_value_counts": [],
        "nan_value_counts": [],
        "lower_bounds": [{"key": 1, "value": b"\x01"}],
        "upper_bounds": [],
        "split_offsets": None,
        "equality_ids": None,
        "sort_order_id": None,
        "key_metadata": b"secret-key-id",
        **extra,
    }


def _newer_record(payload: tuple[str, dict[str, Any]], event_type: str) -> dict[str, Any]:
    name, body = payload
    return {
        "event_id": EVENT_ID,
        "type": event_type,
        "timestamp_ms": TS,
        "group_id": "g",
        "trace_id": "trace-1",
        "writer": {"writer_id": "w", "epoch": 2},
        "batch_seq": 9,
        "payload": {"-type": f"io.icefloe.events.{name}", **body},
    }


def test_reader_drops_fields_added_by_a_newer_writer() -> None:
    record = _newer_record(
        (
            "DataWritten",
            {"commit_id": None, "table": "db.t", "table_uuid": None, "files": [_file_record()]},
        ),
        "DATA_WRITTEN",
    )
    event = decode_event(_frame(_extended_schema(), record))
    assert event == Event(
        group_id="g",
        payload=DataWritten(
            table="db.t",
            files=(
                DataFileMeta(
                    path="s3://b/t/f.parquet",
                    record_count=10,
                    file_size_in_bytes=100,
                    partition=(PartitionValue(1000, "day", 19_700),),
                    column_sizes={1: 40},
                    lower_bounds={1: b"\x01"},
                ),
            ),
        ),
        writer=WriterRef("w", 2),
        batch_seq=9,
        event_id=EVENT_ID,
        timestamp_ms=TS,
    )


def test_reader_takes_defaults_for_fields_an_older_writer_lacks() -> None:
    schema = copy.deepcopy(ENVELOPE_SCHEMA)
    schema["fields"] = [f for f in schema["fields"] if f["name"] not in ("writer", "batch_seq")]
    record = {
        "event_id": EVENT_ID,
        "type": "COMMIT_COMPLETE",
        "timestamp_ms": TS,
        "group_id": "g",
        "payload": {"-type": "io.icefloe.events.CommitComplete", "commit_id": COMMIT},
    }
    event = decode_event(_frame(schema, record))
    assert event == Event("g", CommitComplete(COMMIT), event_id=EVENT_ID, timestamp_ms=TS)


def test_unknown_payload_type_from_a_newer_writer_is_a_decode_error() -> None:
    record = _newer_record(("Heartbeat", {"load": 0.5}), "START_COMMIT")
    with pytest.raises(EventDecodeError):
        decode_event(_frame(_extended_schema(), record))


def test_unknown_file_content_is_a_decode_error_never_data() -> None:
    body = {
        "commit_id": None,
        "table": "db.t",
        "table_uuid": None,
        "files": [_file_record(content="DELETION_VECTOR")],
    }
    with pytest.raises(EventDecodeError):
        decode_event(
            _frame(_extended_schema(), _newer_record(("DataWritten", body), "DATA_WRITTEN"))
        )


def test_type_must_match_payload() -> None:
    record = _newer_record(("StartCommit", {"commit_id": COMMIT}), "COMMIT_COMPLETE")
    with pytest.raises(EventDecodeError, match="does not match"):
        decode_event(_frame(_extended_schema(), record))


# --------------------------------------------------------------------------- bad input


def test_wrong_magic() -> None:
    data = encode_event(EVENTS["start_commit"])
    with pytest.raises(EventDecodeError, match="bad magic"):
        decode_event(b"XX" + data[2:])


def test_unsupported_format_version_names_both_versions() -> None:
    data = encode_event(EVENTS["start_commit"])
    with pytest.raises(EventDecodeError, match=rf"version 7 .*reads {FORMAT_VERSION}"):
        decode_event(data[:2] + bytes([7]) + data[3:])


@pytest.mark.parametrize("data", [b"", b"I", b"IF", b"IF\x01", b"IF\x01\x00\x00\x00"])
def test_short_input(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_event(data)


def test_not_bytes() -> None:
    with pytest.raises(EventDecodeError, match="expected bytes"):
        decode_event("IF\x01")  # type: ignore[arg-type]


def test_trailing_bytes() -> None:
    with pytest.raises(EventDecodeError, match="trailing"):
        decode_event(encode_event(EVENTS["start_commit"]) + b"\x00")


def test_schema_length_beyond_the_data() -> None:
    data = encode_event(EVENTS["start_commit"])
    with pytest.raises(EventDecodeError, match="truncated"):
        decode_event(data[:3] + struct.pack(">I", len(data)) + data[7:])


def test_compressed_schema_bomb_is_refused() -> None:
    bomb = zlib.compress(b" " * (64 << 20), 9)
    data = MAGIC + bytes([FORMAT_VERSION]) + struct.pack(">I", len(bomb)) + bomb + b"\x00"
    with pytest.raises(EventDecodeError, match="larger than"):
        decode_event(data)


@pytest.mark.parametrize(
    "items",
    [
        "null",
        {"type": "record", "name": "Empty", "fields": [{"name": "n", "type": "null"}]},
        {"type": "fixed", "name": "Nothing", "size": 0},
    ],
)
def test_writer_schema_with_zero_width_array_items_is_refused(items: Any) -> None:
    # 2**40 empty items need 6 bytes of input: without the check this would never finish
    schema = copy.deepcopy(ENVELOPE_SCHEMA)
    schema["fields"].insert(0, {"name": "junk", "type": {"type": "array", "items": items}})
    raw = zlib.compress(json.dumps(schema).encode())
    body = b"\x80\x80\x80\x80\x80\x40\x00"  # zigzag varint 2**40, then end of array
    data = MAGIC + bytes([FORMAT_VERSION]) + struct.pack(">I", len(raw)) + raw + body
    with pytest.raises(EventDecodeError, match="zero-width"):
        decode_event(data)


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_every_truncation_is_a_decode_error(name: str) -> None:
    data = encode_event(EVENTS[name])
    for cut in range(len(data)):
        with pytest.raises(EventDecodeError):
            decode_event(data[:cut])


# --------------------------------------------------------------------------- hypothesis


def _decode_only_typed_error(data: bytes) -> None:
    """Decoding may succeed (a flipped bit can leave a valid event) or raise the typed error;
    any other exception fails the test."""
    with contextlib.suppress(EventDecodeError):
        decode_event(data)


ints = st.integers(-(2**31), 2**31 - 1)
longs = st.integers(-(2**63), 2**63 - 1)
texts = st.text(max_size=20)
scalars = st.one_of(
    st.none(), st.booleans(), longs, st.floats(allow_nan=False), texts, st.binary(max_size=16)
)
files = st.builds(
    DataFileMeta,
    path=texts,
    record_count=longs,
    file_size_in_bytes=longs,
    file_format=st.sampled_from(["PARQUET", "AVRO", "ORC"]),
    content=st.sampled_from(list(FileContent)),
    spec_id=ints,
    partition=st.lists(st.builds(PartitionValue, ints, texts, scalars), max_size=4).map(tuple),
    column_sizes=st.dictionaries(ints, longs, max_size=3),
    value_counts=st.dictionaries(ints, longs, max_size=3),
    null_value_counts=st.dictionaries(ints, longs, max_size=3),
    nan_value_counts=st.dictionaries(ints, longs, max_size=3),
    lower_bounds=st.dictionaries(ints, st.binary(max_size=8), max_size=3),
    upper_bounds=st.dictionaries(ints, st.binary(max_size=8), max_size=3),
    split_offsets=st.none() | st.lists(longs, max_size=3).map(tuple),
    equality_ids=st.none() | st.lists(ints, max_size=3).map(tuple),
    sort_order_id=st.none() | ints,
)
payloads = st.one_of(
    st.builds(StartCommit, texts),
    st.builds(
        DataWritten,
        table=texts,
        files=st.lists(files, max_size=3).map(tuple),
        commit_id=st.none() | texts,
        table_uuid=st.none() | texts,
    ),
    st.builds(
        DataComplete,
        positions=st.lists(
            st.builds(SourcePosition, texts, ints, longs, st.none() | longs), max_size=3
        ).map(tuple),
        commit_id=st.none() | texts,
    ),
    st.builds(CommitToTable, texts, texts, st.none() | longs, st.none() | longs),
    st.builds(CommitComplete, texts, st.none() | longs),
)
events = st.builds(
    Event,
    group_id=texts,
    payload=payloads,
    writer=st.none() | st.builds(WriterRef, texts, longs),
    batch_seq=st.none() | longs,
    event_id=texts,
    timestamp_ms=longs,
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADER = _split(encode_event(EVENTS["start_commit"]))
VALID_PREFIX = HEADER[0] + HEADER[1]


@FUZZ
@given(events)
def test_random_events_round_trip(event: Event) -> None:
    assert decode_event(encode_event(event)) == event


def _validated_encoding(event: Event) -> bytes:
    """The event encoded as before the payload and writer were handed to fastavro as named
    union branches: plain records, the payload's branch named by a "-type" key, every union
    resolved by fastavro's validating search."""
    wire = encode_event(event)
    body = _split(wire)[2]
    record = fastavro.schemaless_reader(io.BytesIO(body), ENVELOPE_SCHEMA)
    assert isinstance(record, dict)
    record["payload"]["-type"] = f"io.icefloe.events.{type(event.payload).__name__}"
    out = io.BytesIO()
    out.write(wire[: len(wire) - len(body)])
    fastavro.schemaless_writer(out, ENVELOPE_SCHEMA, record)
    return out.getvalue()


@FUZZ
@given(events)
def test_encoding_is_byte_identical_to_fastavros_validated_union_search(event: Event) -> None:
    assert encode_event(event) == _validated_encoding(event)


@pytest.mark.timeout(300)
@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_raise_only_the_typed_error(data: bytes) -> None:
    _decode_only_typed_error(data)


@pytest.mark.timeout(300)
@FUZZ
@given(st.binary(max_size=4096))
def test_random_body_after_a_valid_header_raises_only_the_typed_error(body: bytes) -> None:
    _decode_only_typed_error(VALID_PREFIX + body)


@pytest.mark.timeout(300)
@FUZZ
@given(events, st.data())
def test_truncated_random_events_raise_the_typed_error(event: Event, data: st.DataObject) -> None:
    wire = encode_event(event)
    cut = data.draw(st.integers(0, len(wire) - 1))
    with pytest.raises(EventDecodeError):
        decode_event(wire[:cut])


@pytest.mark.timeout(300)
@FUZZ
@given(events, st.data())
def test_bit_flipped_events_raise_only_the_typed_error(event: Event, data: st.DataObject) -> None:
    wire = bytearray(encode_event(event))
    for _ in range(data.draw(st.integers(1, 3))):
        bit = data.draw(st.integers(0, len(wire) * 8 - 1))
        wire[bit // 8] ^= 1 << (bit % 8)
    _decode_only_typed_error(bytes(wire))


@pytest.mark.timeout(300)
@FUZZ
@given(st.sampled_from(sorted(EVENTS)), st.data())
def test_bytes_spliced_into_golden_events_raise_only_the_typed_error(
    name: str, data: st.DataObject
) -> None:
    wire = bytearray(_golden_path(name).read_bytes())
    at = data.draw(st.integers(7, len(wire)))
    junk = data.draw(st.binary(min_size=1, max_size=16))
    _decode_only_typed_error(bytes(wire[:at] + junk + wire[at + len(junk) :]))


if __name__ == "__main__":
    if sys.argv[1:] != ["--update-golden"]:
        sys.exit("usage: python test_events.py --update-golden")
    update_golden()
