"""Deprecated old path (one release): the Iceberg committer is in
:mod:`icefloe.commit.committer`."""

from __future__ import annotations

from typing import Any

from icefloe._deprecated import moved_attribute
from icefloe.commit import committer as _committer


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, name, {"IcebergCommitter": _committer})
