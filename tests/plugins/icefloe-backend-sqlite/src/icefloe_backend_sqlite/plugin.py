"""The entry point icefloe loads: the ``sqlite`` backend, as written for contract 1.

Only its shape matters to the tests (core must refuse it before calling any of it): the
registration declares no contract version and the coordinator channel implements only what
contract 1 asked for. The methods say so if they are ever called.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from icefloe.channel import Backend, CoordinatorChannel, WriterChannel
from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl


class SqliteConfig(BaseModel):
    """``[coordination.sqlite]``: the database file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = "channel.db"


def _never(*_: Any, **__: Any) -> Any:
    raise AssertionError("icefloe-core must refuse this contract-1 backend before using it")


class SqliteWriterChannel(WriterChannel):
    open = publish = respond = poll_broadcasts = close = _never


class SqliteCoordinatorChannel(CoordinatorChannel):
    # contract 1: no channel_id(), no end_position()
    acquire = renew = release = seek = poll = broadcast = _never
    store_position = stored_position = prune = close = _never


class SqliteBackend(Backend):
    def __init__(self, config: SqliteConfig, context: BackendContext) -> None:
        self.path = config.path

    def writer(self, writer_id: str) -> WriterChannel:
        return SqliteWriterChannel()

    def coordinator(self, coordinator_id: str) -> CoordinatorChannel:
        # abstract under contract 2 (no channel_id, no end_position): what core refuses
        return SqliteCoordinatorChannel()  # type: ignore[abstract]


@hookimpl
def icefloe_register_backends() -> list[BackendSpec]:
    """Contract 1 had no version to declare."""
    return [BackendSpec("sqlite", SqliteConfig, SqliteBackend, "a channel in a SQLite file")]
