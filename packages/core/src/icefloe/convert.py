"""Deprecated old path (one release): the record converter is in
:mod:`icefloe.records.converter` and :mod:`icefloe.records.conform`, the codec contract in
:mod:`icefloe.hookspecs`, ``record_error`` in :mod:`icefloe.errors`."""

from __future__ import annotations

from typing import Any

from icefloe import errors as _errors
from icefloe import hookspecs as _hookspecs
from icefloe._deprecated import moved_attribute
from icefloe.records import conform as _conform
from icefloe.records import converter as _converter

_HOMES = {
    **dict.fromkeys(("CASE_INSENSITIVE_KEY", "INFER_ALL_KEY", "failing_prefix_end"), _hookspecs),
    "record_error": _errors,
    **dict.fromkeys(("conform", "mapped_names", "table_name_mapping"), _conform),
    **dict.fromkeys(
        (
            "CONVERTER_OPTIONS",
            "Conversion",
            "RecordConverter",
            "Rejected",
            "TargetTable",
            "decode_hint",
            "filter_context",
            "kafka_context",
            "renamed",
        ),
        _converter,
    ),
}


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, name, _HOMES)
