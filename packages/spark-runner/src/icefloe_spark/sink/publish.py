"""Publishing a finished micro-batch through the coordination backend, from the Spark driver.

Spark runs a streaming sink's ``commit(messages, batchId)`` in a Python worker process that the
driver JVM starts, not in the driver's own Python process. A writer identity needs one
long-lived :class:`icefloe.coordination.writer.WriterClient` (its responder thread answers
StartCommit between batches, so an idle query never stalls a commit cycle), and that client
belongs with the pipeline in the driver process. So the pipeline runs a :class:`PublishServer`
on a private Unix socket and the sink's ``commit`` hands its batch to it
(:class:`RemotePublisher`). Without a server (a user wiring ``format("icefloe")`` by hand), the
commit worker keeps its own client (:func:`local_publisher`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Protocol

from icefloe import metrics
from icefloe.channel import Backend
from icefloe.config import PipelineConfig
from icefloe.coordination.writer import WriterClient
from icefloe.errors import IcefloeError
from icefloe.events import DataFileMeta, SourcePosition
from icefloe.plugins.backends import open_backend
from icefloe_spark import faults

log = logging.getLogger("icefloe_spark.publish")

# how long a commit worker waits for the driver to publish before failing the batch
PUBLISH_TIMEOUT_S = 300.0


class PublishError(IcefloeError):
    """The driver could not publish a batch; the micro-batch fails and Spark re-runs it."""


@dataclass(frozen=True)
class PublishRequest:
    """One micro-batch's output, merged over all its tasks: what the writer publishes."""

    batch_seq: int
    files: Mapping[str, tuple[DataFileMeta, ...]]
    positions: tuple[SourcePosition, ...]
    table_uuids: Mapping[str, str]
    records: int = 0
    skipped: int = 0  # bad records the tasks dropped ([errors] policy "skip")
    dead_lettered: int = 0  # bad records written to the dead-letter table

    @property
    def file_count(self) -> int:
        return sum(len(f) for f in self.files.values())


class BatchPublisher(Protocol):
    """Anything that publishes a batch for one writer identity."""

    def publish(self, request: PublishRequest) -> bool:
        """True when the batch was added, False when the backend knew it already."""
        ...


@dataclass
class PublishStats:
    """What the driver published so far (shown by ``icefloe run``)."""

    batches: int = 0
    duplicates: int = 0
    records: int = 0
    files: int = 0
    skipped: int = 0
    dead_lettered: int = 0
    last_batch_seq: int | None = None
    last_batch_records: int = 0  # read by the last batch's tasks (good, skipped, dead-lettered)
    last_publish_at: float | None = None  # time.time()


@dataclass
class WriterPublisher:
    """The writer identity of one streaming query: a started WriterClient over the backend."""

    backend: Backend
    group_id: str
    writer_id: str
    stats: PublishStats = field(default_factory=PublishStats)
    dead_letter_table: str | None = None  # named in the bad-records line
    #: the highest batch this writer id published (by an earlier run, on the channel or in
    #: the tables, then by this one): a batch at or below it is one Spark runs again
    published_through: int | None = None

    def __post_init__(self) -> None:
        self._client = WriterClient(
            self.backend.writer(self.writer_id), self.group_id, self.writer_id
        )
        self._lock = threading.Lock()
        self.epoch: int | None = None

    def start(self) -> WriterPublisher:
        """Register this instance (fencing older ones of the same writer id)."""
        self.epoch = self._client.start()
        log.info("writer %s started with epoch %s", self.writer_id, self.epoch)
        return self

    def publish(self, request: PublishRequest) -> bool:
        """Publish atomically, keyed by (writer_id, batch_seq); a batch Spark runs again
        (a driver that died after publishing it, before Spark recorded it) publishes none of
        its files.

        Why here and not only by the dedupe rule: a backend that cannot tell a batch key it
        holds (Kafka) leaves the second copy to the coordinator, which drops it per table; a
        run that routes the batch's records to other tables (the operator moved a route, a
        table's schema changed what is dead-lettered) would have those tables commit it too.
        The copy published first is the batch; the run's files are left to orphan removal.
        Its positions are published alone (no file): the writer's answers then vouch for the
        batch, which ``run --once`` waits for (``committed_through``)."""
        with self._lock:
            through = self.published_through
            again = through is not None and request.batch_seq <= through
            added = self._client.publish(
                request.batch_seq,
                {} if again else dict(request.files),
                list(request.positions),
                {} if again else dict(request.table_uuids),
            )
            added = added and not again
            self.published_through = max(request.batch_seq, through or 0)
            faults.exit_after_publish(request.batch_seq)
            s = self.stats
            s.batches += 1
            s.duplicates += 0 if added else 1
            s.records += request.records
            s.files += request.file_count
            s.skipped += request.skipped
            s.dead_lettered += request.dead_lettered
            s.last_batch_seq = request.batch_seq
            s.last_batch_records = request.records + request.skipped + request.dead_lettered
            s.last_publish_at = time.time()
            if added:
                self._report_bad_records(request)
                metrics.RECORDS_READ.inc(s.last_batch_records)
                metrics.RECORDS_DEAD_LETTERED.inc(request.dead_lettered)
                metrics.RECORDS_SKIPPED.inc(request.skipped)
                metrics.RECORDS_WRITTEN.inc(request.records)
                metrics.FILES_WRITTEN.inc(request.file_count)
                metrics.BYTES_WRITTEN.inc(
                    sum(f.file_size_in_bytes for fs in request.files.values() for f in fs)
                )
            return added

    def _report_bad_records(self, request: PublishRequest) -> None:
        """One line for a batch's bad records, logged here in the driver (with the run's log
        format: the sink's commit runs in a Python worker), naming only what happened."""
        parts = [f"{request.skipped} skipped"] if request.skipped else []
        if request.dead_lettered:
            parts.append(f"{request.dead_lettered} dead-lettered to {self.dead_letter_table}")
        if parts:
            log.warning(
                "batch %s: bad records: %s",
                request.batch_seq,
                ", ".join(parts),
                extra={
                    "event": "bad_records",
                    "batch": request.batch_seq,
                    "skipped": request.skipped,
                    "dead_lettered": request.dead_lettered,
                },
            )

    @property
    def committed_through(self) -> int | None:
        """Every batch up to this batch_seq is committed to the tables (None: none known)."""
        return self._client.committed_through

    def close(self) -> None:
        self._client.close()


class PublishServer:
    """Serves :class:`PublishRequest`s from the sink's commit worker on a Unix socket.

    multiprocessing's Listener frames and authenticates (HMAC challenge with ``secret``) the
    pickled requests; the socket also sits in a directory only this user can enter.
    """

    def __init__(self, publisher: BatchPublisher) -> None:
        self.publisher = publisher
        self.secret = secrets.token_hex(32)
        self._dir = Path(tempfile.mkdtemp(prefix="icefloe-pub-"))  # created mode 0700
        self.address = str(self._dir / "publish.sock")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.secret.encode())
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="icefloe-publish", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception:  # closed listener, or a peer that failed authentication
                if self._closed.is_set():
                    return
                log.warning("publish server: rejected a connection", exc_info=True)
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: Connection) -> None:
        with conn:
            try:
                request = conn.recv()
                if not isinstance(request, PublishRequest):
                    raise PublishError(f"unexpected request {type(request).__name__}")
                conn.send(("ok", self.publisher.publish(request)))
            except Exception as exc:
                log.exception("publishing failed")
                with contextlib.suppress(OSError):
                    conn.send(("error", f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        self._closed.set()
        # closing a listening socket does not wake a thread blocked in accept(): connect once
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
            wake.connect(self.address)
        self._thread.join(timeout=5)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass(frozen=True)
class RemotePublisher:
    """The commit worker's side: hands the batch to the driver's :class:`PublishServer`."""

    address: str
    secret: str
    timeout_s: float = PUBLISH_TIMEOUT_S

    def publish(self, request: PublishRequest) -> bool:
        try:
            with Client(self.address, family="AF_UNIX", authkey=self.secret.encode()) as conn:
                conn.send(request)
                if not conn.poll(self.timeout_s):
                    raise PublishError(
                        f"the driver did not publish batch {request.batch_seq} within "
                        f"{self.timeout_s:.0f}s"
                    )
                status, value = conn.recv()
        except (OSError, EOFError) as exc:
            raise PublishError(
                f"cannot reach the driver's publisher at {self.address} ({exc}); "
                "is the pipeline still running?"
            ) from exc
        if status != "ok":
            raise PublishError(f"the driver failed to publish batch {request.batch_seq}: {value}")
        return bool(value)


_local_lock = threading.Lock()
_local: dict[tuple[str, str], tuple[Backend, WriterPublisher]] = {}


def local_publisher(config: PipelineConfig, writer_id: str) -> WriterPublisher:
    """A process-wide publisher for ``writer_id``, opened on first use and closed at exit.

    Used when no pipeline server is running. Spark keeps reusing the same commit worker for a
    query, so the client (and its responder thread) usually outlives one batch; if Spark starts
    a new worker, its client simply fences the old one.
    """
    key = (config.name, writer_id)
    with _local_lock:
        if key not in _local:
            backend = open_backend(config)
            publisher = WriterPublisher(
                backend, config.name, writer_id, dead_letter_table=config.errors.dead_letter_table
            ).start()
            _local[key] = (backend, publisher)
            if len(_local) == 1:
                atexit.register(close_local_publishers)
        return _local[key][1]


def close_local_publishers() -> None:
    """Close what :func:`local_publisher` opened in this process."""
    with _local_lock:
        for backend, publisher in _local.values():
            try:
                publisher.close()
            finally:
                backend.close()
        _local.clear()
