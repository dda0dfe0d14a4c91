"""icefloe plugin entry point (hook implementations): the built-in record codecs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from icefloe.hookspecs import CodecSpec, RecordCodec, hookimpl


def _json(options: dict[str, Any]) -> RecordCodec:
    from icefloe.records.codecs.json import JsonCodec

    return JsonCodec(options)


def _avro(options: dict[str, Any]) -> RecordCodec:
    from icefloe.records.codecs.avro import AvroCodec

    return AvroCodec(options)


@hookimpl
def icefloe_register_codecs() -> Sequence[CodecSpec]:
    return [
        CodecSpec("json", _json, "one JSON object per value, parsed a whole batch at a time"),
        CodecSpec(
            "avro",
            _avro,
            "Avro binary with a schema from a file or inline; optional Confluent wire format",
        ),
    ]
