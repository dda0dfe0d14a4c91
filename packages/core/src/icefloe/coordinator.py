"""Deprecated old path (one release): the coordinator is in
:mod:`icefloe.coordination.coordinator`, its settings in :mod:`icefloe.coordination.settings`."""

from __future__ import annotations

from typing import Any

from icefloe._deprecated import moved_attribute
from icefloe.coordination import coordinator as _coordinator
from icefloe.coordination import settings as _settings

_HOMES = {"Coordinator": _coordinator, "CoordinatorSettings": _settings}


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, name, _HOMES)
