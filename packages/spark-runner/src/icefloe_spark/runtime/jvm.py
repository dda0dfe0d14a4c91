"""Spark's driver JVM: its settings, its launch, and launching it early.

The JVM and SparkContext are the longest step before a pipeline's first batch, and they need
nothing from the catalog, the backend or the coordinator. ``icefloe run`` therefore launches the
JVM (:func:`launch_early`) as soon as it has read the pipeline file, before it imports the rest
of the runner; :func:`icefloe_spark.pipeline.build_session` then finds it running. This module
stays light to import for that reason (PySpark is imported by the launch itself).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from icefloe.errors import IcefloeError
from icefloe_spark.runtime import classdata, sparkhome, sparklog

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from icefloe.config import PipelineConfig

log = logging.getLogger("icefloe_spark.jvm")

NO_BYTECODE = "PYTHONDONTWRITEBYTECODE"
# keep the pipeline config (catalog credentials) and the publisher secret out of Spark's plans
_REDACT_OPTIONS = "(?i)url|config|secret"

QUICK_JIT = "-XX:TieredStopAtLevel=1"
#: what a launched JVM does with the class-data cache (:mod:`icefloe_spark.runtime.classdata`)
ClassDataUse = Literal["off", "read", "write"]
#: a JVM writing its class data takes about 10 s to exit
END_TIMEOUT_S = 120.0

_early_lock = threading.Lock()
_early: tuple[threading.Thread, str, dict[str, str]] | None = None


@dataclass(frozen=True)
class _Launched:
    """The JVM this process launched, while it writes class data to keep at its end."""

    proc: subprocess.Popen[bytes]
    archive: classdata.Archive
    class_path: str


_launched: _Launched | None = None
#: lines of Spark's log an error about a JVM that did not start quotes
START_FAILURE_LINES = 20


class SparkStartError(IcefloeError):
    """Spark's JVM exited before it was ready. Its output went to Spark's log file, so the
    error quotes the file's last lines: the reason (a bad Java option, no memory) is there."""


def session_conf(config: PipelineConfig, log_level: int = logging.INFO) -> dict[str, str]:
    """The Spark settings of this pipeline's session, with our log4j configuration (a new log
    directory per call). Python workers run this interpreter (else they start under whatever
    ``python3`` is first on PATH, without icefloe installed)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    conf = {
        "spark.master": config.spark.master,
        "spark.app.name": config.spark.app_name,
        "spark.sql.redaction.options.regex": _REDACT_OPTIONS,
        "spark.ui.showConsoleProgress": "false",  # it would scribble over the live view
        # see launch_detached_gateway: executors' Python workers (on a cluster) likewise
        f"spark.executorEnv.{NO_BYTECODE}": "",
        **config.spark.conf,
    }
    if config.spark.data_path == "ranges":
        conf.update(quick_jit(conf))
    if config.spark.commit_tasks:
        # commit jobs (icefloe_spark.committers, their own scheduler pool) share the
        # executors with the query's jobs instead of queueing behind a long micro-batch
        conf.setdefault("spark.scheduler.mode", "FAIR")
    conf.update(sparklog.java_options(conf, config.name, log_level))
    return conf


def quick_jit(conf: Mapping[str, str]) -> dict[str, str]:
    """The JVMs' options with only the quick (C1) JIT compiler, unless the user set the
    compilers. On the ranges path the JVM plans and schedules while Python moves the records,
    so the optimizing (C2) compiler's work never pays back: measured here, the driver JVM
    used 21 -> 12 CPU s to the first commit and 3.6 -> 1.7 CPU s per 2 million records
    (docs/benchmarks.md). The records path keeps both compilers."""
    out = {}
    for key in ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"):
        current = conf.get(key, "")
        if "Tiered" not in current:
            out[key] = f"{current} {QUICK_JIT}".strip()
    return out


def _class_data(
    conf: Mapping[str, str], spark_home: str | None, use: ClassDataUse
) -> classdata.Archive | None:
    if use == "off" or not classdata.wanted(conf):
        return None
    home = Path(spark_home or os.environ.get(sparkhome.SPARK_HOME_ENV) or sparkhome.pyspark_home())
    return classdata.prepare(
        sparkhome.cache_dir() / "class-data",
        home,
        conf.get("spark.driver.extraClassPath", ""),
        write=use == "write",
    )


@contextlib.contextmanager
def _environ(changes: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``changes`` (None: unset) inside the block, as it was after it:
    the launched JVM inherits the environment, this process keeps its own."""
    saved = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            _set_env(name, value)
        yield
    finally:
        for name, value in saved.items():
            _set_env(name, value)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def launch_detached_gateway(conf: Mapping[str, str], class_data: ClassDataUse = "read") -> None:
    """Start Spark's gateway JVM in a new session (process group) unless one runs already.

    Supervisors signal the whole process group on stop; a JVM in the group would die under
    the running query (``Cannot call methods on a stopped SparkContext``, exit 1). Detached,
    it stops only when the driver stops it, and still exits when this process dies (PySpark
    closes its stdin pipe). Uses PySpark's documented ``popen_kwargs`` launch hook.

    Its SPARK_HOME is :func:`icefloe_spark.runtime.sparkhome.jvm_spark_home` (Python processes
    import PySpark with bytecode caches); ``class_data`` says whether it maps the kept class-data
    archive (``read``), or writes one as it exits when none is kept (``write``: then
    :func:`end` must end it, to keep the file).
    """
    global _launched
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
        return
    home = sparkhome.jvm_spark_home()
    archive = _class_data(conf, home, class_data)
    spark_conf = SparkConf(loadDefaults=False)
    for key, value in conf.items():
        spark_conf.set(key, value)
    if archive is not None:
        options = conf.get("spark.driver.extraJavaOptions", "")
        spark_conf.set("spark.driver.extraJavaOptions", f"{options} {archive.java_options()}")
    # Spark starts a fresh Python process for each step of a Python data source's life and
    # forks workers for the tasks; without bytecode caches each one compiles pyspark, pyarrow,
    # pyiceberg and icefloe from source again (4-5 s of CPU a process here, most of the first
    # micro-batch), so the JVM and the Python processes it starts may write them even where
    # the driver's environment says not to (an empty value is "unset" to Python)
    changes: dict[str, str | None] = {NO_BYTECODE: None}
    if home is not None:
        changes[sparkhome.SPARK_HOME_ENV] = home
    popen: dict[str, Any] = {"start_new_session": True}
    # The JVM's own stdout and stderr (its banner, Python workers' stray output) go to Spark's
    # log file when it has one (not under -v): else a stopping query's Python source runner,
    # whose socket the JVM closes, may print a stray traceback under "stopped cleanly"
    log_file = sparklog.log_file_of(conf)
    with contextlib.ExitStack() as files:
        if log_file is not None:
            output = files.enter_context(log_file.open("ab"))  # the JVM keeps its copy
            popen["stdout"], popen["stderr"] = output, subprocess.STDOUT
            start = output.tell()  # an early launch that failed wrote before this one
        with _environ(changes):
            try:
                gateway = launch_gateway(spark_conf, popen_kwargs=popen)  # type: ignore[no-untyped-call]
            except Exception as exc:
                if log_file is None:
                    raise  # its output is on the terminal
                raise SparkStartError(_start_failure(exc, log_file, start)) from exc
    SparkContext._ensure_initialized(gateway=gateway)
    if archive is not None and archive.write is not None:
        class_path = gateway.jvm.java.lang.System.getProperty("java.class.path")
        _launched = _Launched(gateway.proc, archive, str(class_path))


def _start_failure(exc: Exception, log_file: Path, start: int) -> str:
    with log_file.open("rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").strip().splitlines()[-START_FAILURE_LINES:]
    shown = "\n".join(f"  {line}" for line in lines) or "  (it wrote nothing)"
    return f"Spark's JVM did not start ({exc}); the end of its output ({log_file}):\n{shown}"


def session(conf: Mapping[str, str], class_data: ClassDataUse = "read") -> SparkSession:
    """A SparkSession with ``conf`` on a JVM launched by :func:`launch_detached_gateway` (or
    the one already running)."""
    from pyspark.sql import SparkSession

    launch_detached_gateway(conf, class_data)
    builder: Any = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    built: SparkSession = builder.getOrCreate()
    return built


def writes_class_data() -> bool:
    """Whether the JVM this process launched writes class data as it exits."""
    return _launched is not None


def end(timeout_s: float = END_TIMEOUT_S) -> Path | None:
    """End the JVM this process launched to write class data, after the session stopped,
    and keep the archive it wrote as it exited (:func:`icefloe_spark.runtime.classdata.keep`). The
    kept path; None when there was nothing to keep, or the JVM did not end in time."""
    global _launched
    from pyspark import SparkContext

    launched, _launched = _launched, None
    if launched is None:
        return None
    if launched.proc.stdin is not None:
        with contextlib.suppress(OSError):
            launched.proc.stdin.close()  # the JVM exits when its stdin ends
    try:
        launched.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("the JVM did not end within %.0f s; its class data is not kept", timeout_s)
        return None
    SparkContext._gateway = None
    SparkContext._jvm = None
    return classdata.keep(launched.archive, launched.class_path)


def _key(config: PipelineConfig, log_level: int) -> str:
    return f"{log_level}:{config.name}:{config.spark.model_dump_json()}"


def launch_early(config: PipelineConfig, log_level: int = logging.INFO) -> None:
    """Launch the JVM for ``config`` in a helper thread now; :func:`early_conf` hands its
    settings to the session built later. A failure here is only logged: building the session
    launches again and reports it."""
    global _early
    with _early_lock:
        if _early is not None:
            return
        conf = session_conf(config, log_level)

        def launch() -> None:
            try:
                launch_detached_gateway(conf, "write" if config.spark.class_data_cache else "off")
            except Exception:
                log.debug("early JVM launch failed; the session launches it again", exc_info=True)

        # The launch forks in that thread while this one imports the runner. CPython runs the
        # fork handlers registered when a fork starts before it and those registered by the
        # time it ends after it, so a module imported meanwhile that registers a pair
        # (concurrent.futures.thread: acquire before, release after) releases a lock it
        # never took ("RuntimeError: release unlocked lock", seen in CI). Register it first.
        import concurrent.futures.thread  # noqa: F401

        thread = threading.Thread(target=launch, name="icefloe-jvm-launch", daemon=True)
        _early = (thread, _key(config, log_level), conf)
        thread.start()


def early_conf(config: PipelineConfig, log_level: int = logging.INFO) -> dict[str, str] | None:
    """The settings the JVM was launched early with, once that launch has ended, if it was for
    this pipeline and log level; else None (nothing was launched early, or for another)."""
    with _early_lock:
        early = _early
    if early is None:
        return None
    thread, key, conf = early
    thread.join()
    return dict(conf) if key == _key(config, log_level) else None
