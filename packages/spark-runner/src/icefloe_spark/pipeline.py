"""Build and run one pipeline's streaming query from a :class:`PipelineConfig`.

The driver process holds, for the life of the query: the writer identity (one
:class:`WriterPublisher` over the configured backend, served to the sink's commit worker by a
:class:`PublishServer`), and by default a coordinator thread. Coordinators elect a leader, so
several drivers of one pipeline (or a standalone ``icefloe coordinator``) can run side by side;
``coordinator=False`` leaves committing to a standalone one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from pyiceberg.catalog import Catalog, load_catalog
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from icefloe.channel import Backend
from icefloe.commit.policy import TablePolicies
from icefloe.config import PipelineConfig
from icefloe.coordination.coordinator import Coordinator, CoordinatorSettings
from icefloe.coordination.processes import CommittersFactory, WorkerSpec
from icefloe.coordination.resume import check_batch_continuity, committed, published, start_offsets
from icefloe.errors import ChannelIdentityError, ConfigError
from icefloe.ops.tables import pipeline_tables
from icefloe.plugins.backends import open_backend
from icefloe.plugins.manager import Plugins, get_plugins
from icefloe.records.codecs.options import self_contained
from icefloe_spark import faults
from icefloe_spark.committers import SparkCommitters
from icefloe_spark.kafka.options import source_options
from icefloe_spark.kafka.source import RANGES_SOURCE_NAME, SOURCE_NAME, register_sources
from icefloe_spark.replay import RollbackWatcher
from icefloe_spark.runtime import jvm, sparklog
from icefloe_spark.sink.datasource import (
    OPT_SOURCE,
    SINK_NAME,
    IcefloeSink,
    checkpoint_filesystem,
    derive_writer_id,
    sink_options,
)
from icefloe_spark.sink.publish import PublishServer, PublishStats, WriterPublisher
from icefloe_spark.sink.tables import ensure_tables

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_ROOT = ".icefloe/checkpoints"
_COORDINATOR_RETRY_S = 2.0
_SESSION_WAIT_S = 300.0  # a commit job's longest wait for the session the query starts


def checkpoint_location(config: PipelineConfig, override: str | None = None) -> str:
    """Where Spark keeps this query's offsets: ``--checkpoint``, ``spark.checkpoint_location``
    or ``.icefloe/checkpoints/<name>`` under the working directory."""
    location = override or config.spark.checkpoint_location
    if location:
        return location
    return str(Path(DEFAULT_CHECKPOINT_ROOT, config.name).absolute())


def checkpoint_batch(location: str, properties: Mapping[str, str] | None = None) -> int | None:
    """The newest batch id Spark planned in this checkpoint (its offsets log), or None for a
    new or empty checkpoint. Read as :func:`checkpoint_filesystem` opens it (``properties``:
    the catalog's FileIO settings, for a checkpoint on the warehouse's object store)."""
    from pyarrow import fs as pafs

    filesystem, base = checkpoint_filesystem(location, properties)
    selector = pafs.FileSelector(base.rstrip("/") + "/offsets", allow_not_found=True)
    ids = [int(i.base_name) for i in filesystem.get_file_info(selector) if i.base_name.isdigit()]
    return max(ids, default=None)


def check_checkpoint_filesystem(spark: SparkSession, location: str) -> None:
    """Refuse, before the query starts, a checkpoint whose scheme Spark's Hadoop has no file
    system for: PySpark's wheel ships none for ``s3a://`` (Hadoop's S3 connector,
    ``hadoop-aws``, is a separate jar), and Spark would fail the query with a Java stack trace
    instead (docs/spark-runner.md says what to add)."""
    from py4j.protocol import Py4JJavaError

    scheme = urlsplit(location).scheme.lower()
    if scheme in ("", "file") or len(scheme) == 1:  # a local path (or a Windows drive)
        return
    context = spark.sparkContext
    jvm: Any = context._jvm
    try:
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(
            scheme, context._jsc.hadoopConfiguration()
        )
    except Py4JJavaError as exc:
        cause = str(exc.java_exception).splitlines()[0]
        hadoop = jvm.org.apache.hadoop.util.VersionInfo.getVersion()
        connector = (
            f"add Hadoop's S3 connector: spark.jars.packages = "
            f"'org.apache.hadoop:hadoop-aws:{hadoop}' (or spark.jars with hadoop-aws and the "
            "AWS SDK bundle it names) and the store's spark.hadoop.fs.s3a.* settings"
            if scheme in ("s3a", "s3", "s3n")
            else f"add the Hadoop file system jar for {scheme}:// to spark.jars"
        )
        raise ConfigError(
            "spark.checkpoint_location",
            f"Spark (Hadoop {hadoop}) has no file system for {scheme}:// ({cause})",
            f"{connector}; or put the checkpoint where Spark can write (a shared mount, hdfs://)",
            location,
        ) from None


def build_session(config: PipelineConfig, log_level: int = logging.INFO) -> SparkSession:
    """A SparkSession for this pipeline (settings: :func:`icefloe_spark.runtime.jvm.session_conf`).

    The JVM is started in a session of its own (see :func:`jvm.launch_detached_gateway`), unless
    ``icefloe run`` launched it early for this pipeline
    (:func:`icefloe_spark.runtime.jvm.launch_early`), and logs to a file unless debugging (see
    :mod:`icefloe_spark.runtime.sparklog`).
    """
    conf = jvm.early_conf(config, log_level) or jvm.session_conf(config, log_level)
    previous_sigint = signal.getsignal(signal.SIGINT)
    session = jvm.session(conf, "read" if config.spark.class_data_cache else "off")
    # SparkContext replaces the SIGINT handler with one raising KeyboardInterrupt: keep ours
    # (only the main thread may set handlers; PySpark sets none from other threads either)
    if previous_sigint is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, previous_sigint)
    return session


def any_keyed(config: PipelineConfig) -> bool:
    """Whether some table replaces rows by key: then one partition's records of a batch stay
    in one task, where the last change per key is decided."""
    dynamic = config.dynamic_tables
    return any(t.keyed for t in config.tables) or (dynamic is not None and dynamic.keyed)


def activate(session: SparkSession) -> SparkSession:
    """Make ``session`` the JVM's active session of the calling thread, as building it there
    would have. Why: the session is built in a helper thread (to overlap start-up), and the
    JVM finds Python data sources registered on a session through the *active* session of
    the thread that starts the query (else ``DATA_SOURCE_NOT_FOUND: icefloe``). PySpark
    offers no public call for this (``createDataFrame`` does it as a side effect)."""
    jvm = session._jvm
    assert jvm is not None
    SparkSession._get_j_spark_session_class(jvm).setActiveSession(session._jsparkSession)
    return session


def register(spark: SparkSession) -> None:
    """Make ``icefloe-kafka`` and ``icefloe`` known to this session."""
    register_sources(spark)
    spark.dataSource.register(IcefloeSink)


def open_catalog(config: PipelineConfig) -> Catalog:
    return load_catalog(config.catalog.name, **config.catalog.properties)


class CoordinatorThread:
    """Runs :meth:`Coordinator.run` in the driver until stopped, restarting it after errors
    (leadership moves to another coordinator meanwhile, if one runs).

    A :class:`~icefloe.errors.ChannelIdentityError` (the channel changed without a drain, or
    was reset) ends it for good instead: no retry can fix it, the operator has to act on its
    message. It is kept in :attr:`fatal`; ``icefloe run`` then stops and exits with it.
    """

    def __init__(
        self,
        config: PipelineConfig,
        backend: Backend,
        catalog: Catalog,
        plugins: Plugins,
        committers: CommittersFactory | None = None,
    ) -> None:
        """``committers``: where the coordinator commits a cycle's tables (Spark tasks, with
        ``spark.commit_tasks``); None: as ``[coordination]`` says."""
        self.config = config
        self.committers = committers
        self.backend = backend
        self.catalog = catalog
        self.plugins = plugins
        self.coordinator_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.stop_event = threading.Event()
        self.last_error: str | None = None
        self.fatal: ChannelIdentityError | None = None
        self._fault_hooks = faults.coordinator_hooks()  # one count across restarts
        self._thread = threading.Thread(target=self._run, name="icefloe-coordinator", daemon=True)

    def start(self) -> CoordinatorThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        settings = CoordinatorSettings.for_pipeline(self.config)
        while not self.stop_event.is_set():
            coordinator = Coordinator(
                self.config.name,
                self.backend.coordinator(self.coordinator_id),
                self.catalog,
                settings,
                coordinator_id=self.coordinator_id,
                plugins=self.plugins,
                hooks=self._fault_hooks,
                committers=self.committers,
            )
            try:
                coordinator.run(self.stop_event)
            except ChannelIdentityError as exc:
                self.fatal = exc
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("coordinator stopped for good: %s", self.last_error)
                self.stop_event.set()
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("coordinator failed; restarting in %.0fs", _COORDINATOR_RETRY_S)
                self.stop_event.wait(_COORDINATOR_RETRY_S)
            finally:
                try:
                    coordinator.close()
                except Exception:
                    log.warning("coordinator close failed", exc_info=True)

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_event.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class Pipeline:
    """One running pipeline: ``start()``, watch ``query``, ``stop()`` (or use ``with``)."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        spark: SparkSession | None = None,
        coordinator: bool = True,
        checkpoint: str | None = None,
        writer_id: str | None = None,
        plugins: Plugins | None = None,
        sink_extra_options: Mapping[str, str] | None = None,
        reader: Callable[[SparkSession], DataFrame] | None = None,
        source_extra_options: Mapping[str, str] | None = None,
        once: bool = False,
        log_level: int = logging.INFO,
    ) -> None:
        # executors decode records in other processes, maybe on other machines: ship file
        # contents (an Avro schema_file), never paths
        self.config = config = self_contained(config)
        self.once = once
        self.log_level = log_level
        self.spark_log: Path | None = None
        self.checkpoint = checkpoint_location(config, checkpoint)
        self.writer_id = writer_id or derive_writer_id(
            config.name, self.checkpoint, config.catalog.properties
        )
        self._published_through: int | None = None  # by earlier runs (_check_start)
        self.run_coordinator = coordinator
        self.plugins = plugins or get_plugins()
        self.sink_extra_options = dict(sink_extra_options or {})
        self.reader = reader
        self.source_extra_options = dict(source_extra_options or {})
        self._spark = spark
        self._owns_spark = spark is None
        self._spark_ready = threading.Event()  # set once the query's session is up
        self.spark_committers: list[SparkCommitters] = []
        """The coordinator's commit tasks (``spark.commit_tasks``), one per coordinator built."""
        self.catalog: Catalog | None = None
        self.backend: Backend | None = None
        self.publisher: WriterPublisher | None = None
        self.server: PublishServer | None = None
        self.coordinator: CoordinatorThread | None = None
        self.rollbacks: RollbackWatcher | None = None
        self.query: StreamingQuery | None = None

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            raise RuntimeError("pipeline not started")
        return self._spark

    @property
    def reads_ranges(self) -> bool:
        """Whether the query runs the ``ranges`` data path (sink tasks read the records)."""
        return self.reader is None and self.config.spark.data_path == "ranges"

    @property
    def stats(self) -> PublishStats:
        return self.publisher.stats if self.publisher else PublishStats()

    def start(self) -> Pipeline:
        """Open the backend, start the writer (and coordinator), then the streaming query."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        config = self.config
        # The JVM and SparkContext take seconds to start and need none of the steps below:
        # start them meanwhile (they overlap the catalog, the backend and the coordinator)
        session: Future[SparkSession] | None = None
        if self._spark is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="icefloe-spark-session")
            session = pool.submit(build_session, config, self.log_level)
            pool.shutdown(wait=False)
        try:
            self.catalog = open_catalog(config)
            ensure_tables(self.catalog, config, self.plugins)
            self.backend = open_backend(config, self.plugins)
            resume = self._check_start(self.backend, self.catalog)
            self.publisher = WriterPublisher(
                self.backend,
                config.name,
                self.writer_id,
                dead_letter_table=config.errors.dead_letter_table,
                published_through=self._published_through,
            ).start()
            self.server = PublishServer(self.publisher)
            if self.run_coordinator:
                self.coordinator = CoordinatorThread(
                    config, self.backend, self.catalog, self.plugins, self._committers()
                ).start()
            # every driver watches: a rolled-back table waits for its replay
            # (icefloe.commit.rollback)
            self.rollbacks = RollbackWatcher(
                config,
                self.catalog,
                self.backend,
                {**source_options(config), **self.source_extra_options},
            ).start()
            if self.coordinator is not None:
                self.plugins.pm.register(self.rollbacks)
        except BaseException:
            if session is not None and session.exception() is None:
                self._spark = session.result()  # so that stop() stops it
            raise
        if session is not None:
            self._spark = activate(session.result())
        self._spark_ready.set()
        check_checkpoint_filesystem(self.spark, self.checkpoint)
        self.spark_log = sparklog.log_file_of(dict(self.spark.sparkContext.getConf().getAll()))
        register(self.spark)
        reader_options = {**source_options(config), **resume, **self.source_extra_options}
        ranges = self.reads_ranges
        options = sink_options(
            config,
            self.writer_id,
            self.server.address,
            self.server.secret,
            extra={
                **({OPT_SOURCE: json.dumps(reader_options)} if ranges else {}),
                **self.sink_extra_options,
            },
        )
        writer = (
            self._input(reader_options, ranges)
            .writeStream.format(SINK_NAME)
            .options(**options)
            .option("checkpointLocation", self.checkpoint)
        )
        if self.once:  # read what the source holds now, in batches, then end
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{config.spark.trigger_interval_s} seconds")
        self.query = writer.start()
        log.info(
            "pipeline %s started: query %s, writer %s, checkpoint %s",
            config.name,
            self.query.id,
            self.writer_id,
            self.checkpoint,
        )

    def _committers(self) -> CommittersFactory | None:
        """The coordinator's committers: with ``spark.commit_tasks``, Spark tasks on this
        driver's executors (:mod:`icefloe_spark.committers`)."""
        tasks = self.config.spark.commit_tasks
        if not tasks:
            return None

        def committers(spec: WorkerSpec) -> SparkCommitters:
            built = SparkCommitters(self._session_for_commits, tasks, spec)
            self.spark_committers.append(built)
            return built

        return committers

    def _session_for_commits(self) -> SparkSession:
        """The session, once the query's is up (the coordinator starts before it)."""
        if not self._spark_ready.wait(_SESSION_WAIT_S) or self._spark is None:
            raise RuntimeError("the Spark session is not running: no commit job can start")
        return self._spark

    def _check_start(self, backend: Backend, catalog: Catalog) -> dict[str, str]:
        """Before anything is published: refuse a checkpoint that is behind what this writer
        id already published, and, for a new checkpoint with ``starting_offsets = "table"``,
        return the source options that start after every published batch (the greater of the
        tables' offsets and those of the batches still on the channel; see
        icefloe.coordination.resume)."""
        config = self.config
        latest = checkpoint_batch(self.checkpoint, self.config.catalog.properties)
        channel = backend.coordinator(f"start-{uuid.uuid4().hex[:8]}")
        try:  # the channel before the tables: see icefloe.coordination.resume on the read order
            on_channel = published(channel, config.name)
        finally:
            channel.close()
        # every table the pipeline commits to: the dynamic ones too (a dynamic-only pipeline
        # would otherwise read its whole source again, and a writer id behind what they hold
        # would have its batches dropped as replays)
        tables = pipeline_tables(catalog, config)
        in_tables = committed(catalog, config.name, tables, TablePolicies.from_config(config))
        check_batch_continuity(self.writer_id, latest, on_channel, in_tables, self.checkpoint)
        writer = self.writer_id
        held = [p.batches[writer] for p in (on_channel, in_tables) if writer in p.batches]
        self._published_through = max(held, default=None)
        if (
            latest is not None
            or config.source.starting_offsets != "table"
            or self.reader is not None
            or "startingOffsets" in self.source_extra_options
        ):
            return {}
        offsets = start_offsets(on_channel, in_tables)
        log.info("new checkpoint: starting after every published batch, at %s", offsets)
        nested = {t: {str(p): o for p, o in sorted(ps.items())} for t, ps in offsets.items()}
        return {"startingOffsets": json.dumps(nested)}

    def _input(self, options: Mapping[str, str], ranges: bool) -> DataFrame:
        """The configured source (its offset ranges on the ``ranges`` data path), or the
        caller's streaming DataFrame in Spark's Kafka layout (e.g. from Spark's own ``kafka``
        source where its connector is installed)."""
        if self.reader is not None:
            return self.reader(self.spark)
        if not ranges:
            return self.spark.readStream.format(SOURCE_NAME).options(**options).load()
        split = self.config.spark.max_records_per_task
        if split is not None and not any_keyed(self.config):
            options = {"maxRecordsPerPartition": str(split), **options}
        df: DataFrame = self.spark.readStream.format(RANGES_SOURCE_NAME).options(**options).load()
        return df

    def all_committed(self) -> bool:
        """Whether every batch this driver published is in the tables: a commit cycle this
        writer answered after its last publish completed (``run --once`` exits then)."""
        if self.publisher is None:
            return False
        last = self.publisher.stats.last_batch_seq
        done = self.publisher.committed_through
        return last is None or (done is not None and done >= last)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the query first (no more publishes), then the writer, coordinator and backend.
        A batch interrupted here is re-run from the checkpoint next time and published once."""
        self._spark_ready.set()  # a commit job waiting for a session that never came: give up
        if self.query is not None:
            try:
                self.query.stop()
            except Exception:
                log.warning("stopping the query failed", exc_info=True)
        if self.server is not None:
            self.server.close()
        if self.rollbacks is not None:
            self.rollbacks.stop(timeout)
        if self.coordinator is not None:
            self.coordinator.stop(timeout)
        if self.rollbacks is not None and self.plugins.pm.is_registered(self.rollbacks):
            self.plugins.pm.unregister(self.rollbacks)
        if self.publisher is not None:
            self.publisher.close()
        if self.backend is not None:
            self.backend.close()
        if self._owns_spark and self._spark is not None:
            self._spark.stop()
            self._spark = None
        self.query = self.server = self.coordinator = self.publisher = self.backend = None
        self.rollbacks = None

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
