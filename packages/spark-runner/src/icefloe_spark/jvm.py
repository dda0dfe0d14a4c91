"""Spark's driver JVM: its settings, its launch, and launching it early.

The JVM and SparkContext are the longest step before a pipeline's first batch, and they need
nothing from the catalog, the backend or the coordinator. ``icefloe run`` therefore launches the
JVM (:func:`launch_early`) as soon as it has read the pipeline file, before it imports the rest
of the runner; :func:`icefloe_spark.pipeline.build_session` then finds it running. This module
stays light to import for that reason (PySpark is imported by the launch itself).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from icefloe_spark import sparklog

if TYPE_CHECKING:
    from icefloe.config import PipelineConfig

log = logging.getLogger(__name__)

NO_BYTECODE = "PYTHONDONTWRITEBYTECODE"
# keep the pipeline config (catalog credentials) and the publisher secret out of Spark's plans
_REDACT_OPTIONS = "(?i)url|config|secret"

_early_lock = threading.Lock()
_early: tuple[threading.Thread, str, dict[str, str]] | None = None


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
    conf.update(sparklog.java_options(conf, config.name, log_level))
    return conf


def launch_detached_gateway(conf: Mapping[str, str]) -> None:
    """Start Spark's gateway JVM in a new session (process group) unless one runs already.

    Supervisors signal the whole process group on stop; a JVM in the group would die under
    the running query (``Cannot call methods on a stopped SparkContext``, exit 1). Detached,
    it stops only when the driver stops it, and still exits when this process dies (PySpark
    closes its stdin pipe). Uses PySpark's documented ``popen_kwargs`` launch hook.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
        return
    spark_conf = SparkConf(loadDefaults=False)
    for key, value in conf.items():
        spark_conf.set(key, value)
    # Spark starts a fresh Python process for each step of a Python data source's life and
    # forks workers for the tasks; without bytecode caches each one compiles pyspark, pyarrow,
    # pyiceberg and icefloe from source again (4-5 s of CPU a process here, most of the first
    # micro-batch), so the JVM and the Python processes it starts may write them even where
    # the driver's environment says not to (an empty value is "unset" to Python)
    saved = os.environ.pop(NO_BYTECODE, None)
    try:
        gateway = launch_gateway(  # type: ignore[no-untyped-call]
            spark_conf, popen_kwargs={"start_new_session": True}
        )
    finally:
        if saved is not None:
            os.environ[NO_BYTECODE] = saved
    SparkContext._ensure_initialized(gateway=gateway)


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
                launch_detached_gateway(conf)
            except Exception:
                log.debug("early JVM launch failed; the session launches it again", exc_info=True)

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
