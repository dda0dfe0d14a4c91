"""The Spark runner's part of `icefloe doctor`: the Kafka source and its topics, and Java.

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
