"""icefloe plugin entry point (hook implementations): the Spark runner's CLI commands."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from icefloe.hookspecs import hookimpl

if TYPE_CHECKING:
    from icefloe.config import PipelineConfig
    from icefloe.hookspecs import Check


@hookimpl
def icefloe_cli(app: Any) -> None:
    """Add ``icefloe run`` and ``icefloe demo``; Spark is imported only when they run."""
    from icefloe_spark.cli.commands import register

    register(app)


@hookimpl
def icefloe_source_lag(config: PipelineConfig) -> dict[str, int | None]:
    """`icefloe status`: Kafka partition ends against each table's committed source offsets.
    The brokers are asked on a thread started before pyiceberg is imported, so their answers
    come while this thread imports it (the thread imports nothing but confluent_kafka)."""
    from concurrent.futures import ThreadPoolExecutor

    from icefloe_spark.kafka.admin import source_watermarks
    from icefloe_spark.kafka.options import probe_mode, source_options

    probe = probe_mode(source_options(config)) != "false"
    with ThreadPoolExecutor(1, "icefloe-source-lag") as pool:
        marks = pool.submit(source_watermarks, config.source, probe)
        from pyiceberg.catalog import load_catalog

        from icefloe.ops.fileio import status_properties
        from icefloe_spark.cli.monitor import Monitor

        # status's own FileIO: reading table state here needs no pyarrow.dataset either
        properties = status_properties(config.catalog.properties)
        catalog = load_catalog(config.catalog.name, **properties)
        monitor = Monitor(config, catalog, export_lag=False)  # status serves no metrics
        try:
            return {t.name: t.lag for t in monitor.tables_at(marks.result())}
        finally:
            monitor.close()


@hookimpl
def icefloe_doctor(config: PipelineConfig) -> list[Check]:
    """`icefloe doctor`: the Kafka source and its topics, Java for Spark, and on a cluster the
    paths only this machine can open."""
    from icefloe_spark.checks import cluster_checks, java_check, source_checks

    return [*source_checks(config), java_check(), *cluster_checks(config)]
