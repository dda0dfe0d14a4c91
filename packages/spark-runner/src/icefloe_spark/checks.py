"""The Spark runner's part of `icefloe doctor`: the Kafka source and its topics, Java, and on a
cluster the paths only this machine can open.

Kafka is asked once with a short timeout and a silent client logger: librdkafka otherwise
logs every failed connection attempt (hundreds of ``FAIL`` lines when the broker is down).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from icefloe.config import PipelineConfig
from icefloe.hookspecs import Check

_SILENT = logging.getLogger("icefloe_spark.doctor.librdkafka")
_SILENT.propagate = False
_SILENT.addHandler(logging.NullHandler())
KAFKA_TIMEOUT_S = 2.0  # brokers that are up answer metadata requests in milliseconds


def source_checks(config: PipelineConfig, timeout_s: float = KAFKA_TIMEOUT_S) -> list[Check]:
    """The brokers answer and every configured topic exists."""
    src = config.source
    conf: dict[str, Any] = {
        **src.kafka,
        "bootstrap.servers": src.bootstrap_servers,
        "logger": _SILENT,
    }
    admin = AdminClient(conf)
    try:
        topics = admin.list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        err = exc.args[0] if exc.args else exc
        return [
            Check(
                "kafka source",
                "fail",
                f"cannot reach {src.bootstrap_servers} within {timeout_s:.0f}s ({err}); "
                "check source.bootstrap_servers and that the brokers run",
            )
        ]
    out = [Check("kafka source", "ok", f"{src.bootstrap_servers} answers")]
    if src.topic_pattern is not None:
        found = src.subscribed(topics)
        if not found:
            # not fatal for run (topics created later are read), but nothing flows yet
            out.append(
                Check(
                    f"topic pattern {src.topic_pattern}",
                    "warn",
                    "matches no topic yet; run reads matching topics once they exist",
                )
            )
        else:
            out.append(Check(f"topic pattern {src.topic_pattern}", "ok", ", ".join(found)))
    for topic in src.topics:
        meta = topics.get(topic)
        if meta is None or meta.error is not None:
            out.append(Check(f"topic {topic}", "fail", "does not exist; create it"))
        else:
            out.append(Check(f"topic {topic}", "ok", f"{len(meta.partitions)} partition(s)"))
    return out


def java_check() -> Check:
    """Spark needs a Java runtime (17 here): JAVA_HOME's or the first on PATH."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home, "bin", "java")) if home else shutil.which("java")
    if not java or not Path(java).exists():
        return Check("java", "fail", "no java found; install Java 17 or set JAVA_HOME")
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("java", "fail", f"{java} does not run: {exc}")
    lines = (done.stderr or done.stdout).strip().splitlines()
    if done.returncode != 0:
        return Check("java", "fail", f"{java} -version failed: {lines[:1]}")
    return Check("java", "ok", lines[0] if lines else java)


def _node_local(location: str) -> bool:
    """A path or ``file:`` URL: storage of the machine that names it, not of the cluster."""
    scheme = urlsplit(location).scheme.lower()
    return scheme in ("", "file") or len(scheme) == 1  # a one-letter scheme: a Windows drive


def cluster_checks(config: PipelineConfig) -> list[Check]:
    """With ``spark.master`` a cluster, warn of each local path the executors or a moved
    driver would open on their own machine: an SQLite catalog or a local warehouse opens
    another (or no) file on every node. Warnings, not failures: on a one-machine standalone
    cluster they are shared (docs/spark-runner.md, running on a cluster)."""
    if config.spark.master.startswith("local"):
        return []
    props = config.catalog.properties
    out = []
    uri = props.get("uri", "")
    if uri.startswith("sqlite:"):
        out.append(
            Check(
                "cluster catalog",
                "warn",
                f"catalog uri {uri} is an SQLite file on this machine, which executors on "
                "other nodes cannot open; use a catalog every node reaches (a PostgreSQL "
                "SqlCatalog, REST)",
            )
        )
    warehouse = props.get("warehouse", "")
    # a REST catalog's warehouse is a name the server knows, not a path: only paths count
    if warehouse.startswith(("/", "file:")):
        out.append(
            Check(
                "cluster warehouse",
                "warn",
                f"warehouse {warehouse} is on this machine's disk, where executors on other "
                "nodes cannot write; put it on S3 (or another object store) or HDFS",
            )
        )
    checkpoint = config.spark.checkpoint_location or "(default, under the working directory)"
    if config.spark.checkpoint_location is None or _node_local(checkpoint):
        out.append(
            Check(
                "cluster checkpoint",
                "warn",
                f"spark.checkpoint_location {checkpoint} "
                "is local: only the driver writes it, so a driver restarted on another machine "
                "starts afresh; use HDFS or s3a:// (with hadoop-aws) to let it move",
            )
        )
    if not out:
        out.append(Check("cluster storage", "ok", "catalog, warehouse and checkpoint are shared"))
    return out
