"""For tests of the runner and of pipelines built on it, not used by the runner itself: the
package's tests and the cross-package ones (tests/) share it, as neither can import the
other's conftest."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from pyspark.sql import SparkSession

from icefloe_spark.runtime import jvm


@contextmanager
def local_spark(master: str, conf: Mapping[str, str] | None = None) -> Iterator[SparkSession]:
    """A local SparkSession (``master`` such as ``local[2]``; ``conf`` adds or overrides
    settings) whose Python workers run this interpreter, launched as icefloe launches its own
    (bytecode caches, class data) so that tests start what production starts; quiet but for
    errors, stopped on exit."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    settings = {
        "spark.master": master,
        "spark.app.name": "icefloe-tests",
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2",
        **(conf or {}),
    }
    session = jvm.session(settings)
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
