"""Deprecated old path (one release): the writer client is in
:mod:`icefloe.coordination.writer`."""

from __future__ import annotations

from typing import Any

from icefloe._deprecated import moved_attribute
from icefloe.coordination import writer as _writer


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, name, {"WriterClient": _writer})
