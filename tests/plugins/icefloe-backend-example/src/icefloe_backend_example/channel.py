"""A channel kept in one directory per pipeline: ``events.log`` and ``broadcasts.log`` hold one
base64 event per line (the line number is the offset), ``state.json`` holds epochs, batch
watermarks, the lease and the stored position. An exclusive ``flock`` on ``lock`` serialises
every change, which gives atomic batches and fencing across processes on one machine.
Epochs and fencing tokens start from the clock, so a recreated directory never issues one
again. It never prunes (``prune`` returns 0) and is for demonstration only.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from icefloe.channel import (
    Backend,
    ChannelPosition,
    ChannelRecord,
    CoordinatorChannel,
    Lease,
    WriterBatch,
    WriterChannel,
)
from icefloe.errors import (
    ChannelResetError,
    EventDecodeError,
    NotLeaderError,
    WriterFencedError,
)
from icefloe.events import Event, decode_event, encode_event
from icefloe.hookspecs import BackendContext

PARTITION = "0"


def _clock_us() -> int:
    """Where epochs and fencing tokens start (rule Numbering of icefloe's backend docs)."""
    return time.time_ns() // 1000


class ExampleConfig(BaseModel):
    """``[coordination.example]``. Unknown keys are errors (a typo must not silently fall back
    to a default), and the model is frozen like the project's own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    directory: str
    poll_interval_s: float = Field(default=0.02, gt=0)


class _Store:
    """One pipeline's directory."""

    def __init__(self, root: Path, poll_interval_s: float) -> None:
        self.root = root
        self.poll_interval_s = poll_interval_s
        root.mkdir(parents=True, exist_ok=True)
        for name in ("events.log", "broadcasts.log", "lock"):
            (root / name).touch()
        # the channel's identity is born with its directory; link() is atomic and refuses an
        # existing name, so the first process wins and nobody reads a half-written file
        tmp = root / f"channel-id.{uuid.uuid4().hex}"
        tmp.write_text(uuid.uuid4().hex)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, root / "channel-id")
        tmp.unlink()

    def identity(self) -> str:
        return (self.root / "channel-id").read_text().strip()

    @contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        """The state under the exclusive lock; written back when the block succeeds."""
        with open(self.root / "lock", "rb+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.root / "state.json"
            state: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
            before = json.dumps(state, sort_keys=True)
            yield state
            if json.dumps(state, sort_keys=True) != before:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(state))
                os.replace(tmp, path)

    def append(self, log: str, events: list[Event]) -> None:
        """Append under the caller's lock; one write, so readers see whole lines."""
        self.append_raw(log, [encode_event(e) for e in events])

    def append_raw(self, log: str, payloads: list[bytes]) -> None:
        lines = "".join(base64.b64encode(p).decode() + "\n" for p in payloads)
        with open(self.root / log, "a") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())

    def lines(self, log: str) -> list[str]:
        text = (self.root / log).read_text()
        return text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]

    def wait_lines(self, log: str, start: int, timeout: float) -> list[tuple[int, Event]]:
        """Lines from ``start`` on, decoded. An undecodable line stops the read there: the
        lines before it are returned, and the read that starts at it raises EventDecodeError
        (skipping it could skip a DataWritten)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.lines(log)[start:]
            if lines or time.monotonic() >= deadline:
                out: list[tuple[int, Event]] = []
                for i, x in enumerate(lines):
                    try:
                        out.append((start + i, decode_event(base64.b64decode(x))))
                    except (EventDecodeError, ValueError) as exc:
                        if out:
                            break
                        raise EventDecodeError(f"{log} line {start + i}: {exc}") from exc
                return out
            time.sleep(self.poll_interval_s)


class FileWriter(WriterChannel):
    def __init__(self, store: _Store, writer_id: str) -> None:
        self.store = store
        self.writer_id = writer_id
        self.epoch = 0
        self._next_broadcast = 0

    def open(self) -> int:
        with self.store.locked() as state:
            epochs = state.setdefault("epochs", {})
            self.epoch = epochs.get(self.writer_id, _clock_us()) + 1
            epochs[self.writer_id] = self.epoch
            self._next_broadcast = len(self.store.lines("broadcasts.log"))
        return self.epoch

    def _check_epoch(self, state: dict[str, Any]) -> None:
        current = state.get("epochs", {}).get(self.writer_id, 0)
        if self.epoch == 0 or current != self.epoch:
            raise WriterFencedError(f"writer {self.writer_id} epoch {self.epoch} is fenced")

    def publish(self, batch: WriterBatch) -> bool:
        with self.store.locked() as state:
            self._check_epoch(state)
            published = state.setdefault("published", {})
            if batch.batch_seq <= published.get(self.writer_id, -1):
                return False
            self.store.append("events.log", list(batch.events))
            published[self.writer_id] = batch.batch_seq
        return True

    def respond(self, event: Event) -> None:
        with self.store.locked() as state:
            self._check_epoch(state)
            self.store.append("events.log", [event])

    def poll_broadcasts(self, timeout: float) -> list[Event]:
        got = self.store.wait_lines("broadcasts.log", self._next_broadcast, timeout)
        self._next_broadcast += len(got)
        return [e for _, e in got]

    def close(self) -> None:
        pass


class FileCoordinator(CoordinatorChannel):
    def __init__(self, store: _Store, coordinator_id: str, lease_ttl_s: float) -> None:
        self.store = store
        self.holder = f"{coordinator_id}/{uuid.uuid4()}"  # a restart never reuses a lease
        self.ttl = lease_ttl_s
        self.token = 0
        self._next = 0

    def _lease(self, state: dict[str, Any]) -> Lease:
        state["lease"] = {
            "holder": self.holder,
            "token": self.token,
            "until": time.time() + self.ttl,
        }
        return Lease(self.token, self.holder, time.monotonic() + self.ttl)

    def _check_leader(self, state: dict[str, Any]) -> None:
        lease = state.get("lease") or {}
        if lease.get("holder") != self.holder or lease.get("until", 0) < time.time():
            raise NotLeaderError(f"{self.holder} does not hold the lease")

    def acquire(self, timeout: float) -> Lease | None:
        deadline = time.monotonic() + timeout
        while True:
            with self.store.locked() as state:
                lease = state.get("lease") or {}
                if lease.get("holder") == self.holder or lease.get("until", 0) < time.time():
                    if lease.get("holder") != self.holder:
                        state["token"] = state.get("token", _clock_us()) + 1
                        self.token = state["token"]
                    return self._lease(state)
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.store.poll_interval_s)

    def renew(self) -> Lease:
        with self.store.locked() as state:
            self._check_leader(state)
            return self._lease(state)

    def release(self) -> None:
        with self.store.locked() as state:
            if (state.get("lease") or {}).get("holder") == self.holder:
                state["lease"] = None

    def seek(self, position: ChannelPosition | None) -> None:
        self._next = 0 if position is None else position.get(PARTITION, 0)
        end = self.end_position()[PARTITION]
        if self._next > end:
            raise ChannelResetError(
                f"position {self._next} lies past the end of {self.store.root} ({end}): the "
                "directory was replaced or restored from an older copy"
            )

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        got = self.store.wait_lines("events.log", self._next, timeout)[:max_records]
        self._next += len(got)
        return [ChannelRecord(PARTITION, offset, event) for offset, event in got]

    def broadcast(self, event: Event) -> None:
        with self.store.locked() as state:
            self._check_leader(state)
            self.store.append("broadcasts.log", [event])

    def store_position(self, position: ChannelPosition) -> None:
        with self.store.locked() as state:
            self._check_leader(state)
            state["position"] = dict(position)

    def stored_position(self) -> ChannelPosition | None:
        with self.store.locked() as state:
            position: dict[str, int] | None = state.get("position")
        return position

    def prune(self, before: ChannelPosition) -> int:
        return 0

    def channel_id(self) -> str:
        return f"example:{self.store.identity()}"

    def end_position(self) -> ChannelPosition:
        return {PARTITION: len(self.store.lines("events.log"))}

    def close(self) -> None:
        self.release()


class FileBackend(Backend):
    def __init__(self, config: ExampleConfig, context: BackendContext) -> None:
        # a relative directory is the pipeline file's, in every process
        directory = context.resolve(config.directory)
        self.store = _Store(directory / context.group_id, config.poll_interval_s)
        self.lease_ttl_s = context.lease_ttl_s

    def writer(self, writer_id: str) -> WriterChannel:
        return FileWriter(self.store, writer_id)

    def coordinator(self, coordinator_id: str) -> CoordinatorChannel:
        return FileCoordinator(self.store, coordinator_id, self.lease_ttl_s)

    def inject_undecodable(self, data: bytes, writer_id: str) -> None:
        """Conformance-suite hook: a raw line after everything published (one log)."""
        with self.store.locked():
            self.store.append_raw("events.log", [data])
