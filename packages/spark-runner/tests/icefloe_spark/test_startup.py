"""What keeps start-up short (docs/benchmarks.md, start-up)."""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import pytest

from icefloe.config import PipelineConfig, config_from_dict
from icefloe_spark import jvm

# what only the write tasks need: pyiceberg's catalog and Parquet writer, the converter
TASK_ONLY = ("pyiceberg.catalog", "pyiceberg.io.pyarrow", "icefloe.convert", "icefloe.coordinator")


def config(name: str = "orders") -> PipelineConfig:
    return config_from_dict(
        {
            "name": name,
            "source": {"topics": ["orders"]},
            "tables": [{"name": "db.orders"}],
            "catalog": {"properties": {"uri": "sqlite:///x.db"}},
        }
    )


@pytest.mark.parametrize("module", ["icefloe_spark.sink", "icefloe_spark.source"])
def test_modules_spark_planners_import_leave_the_task_only_parts_out(module: str) -> None:
    """Spark imports these in a fresh process for each planning step of a query and for the
    sink's commit; the parts only write tasks use load when a task uses them."""
    code = f"import sys, {module}; print(sorted(m for m in {TASK_ONLY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_early_launch_hands_its_settings_to_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[dict[str, str]] = []
    monkeypatch.setattr(jvm, "_early", None)
    monkeypatch.setattr(jvm, "launch_detached_gateway", lambda conf: launched.append(dict(conf)))
    jvm.launch_early(config(), logging.INFO)
    jvm.launch_early(config(), logging.INFO)  # once per process
    conf = jvm.early_conf(config(), logging.INFO)
    assert launched == [conf]  # the session is built with the settings the JVM started with
    assert jvm.early_conf(config("other"), logging.INFO) is None
    assert jvm.early_conf(config(), logging.DEBUG) is None  # its log goes elsewhere


def test_a_failed_early_launch_is_left_to_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(conf: Any) -> None:
        raise RuntimeError("no java")

    monkeypatch.setattr(jvm, "_early", None)
    monkeypatch.setattr(jvm, "launch_detached_gateway", fail)
    jvm.launch_early(config(), logging.INFO)
    # the settings are still handed on: building the session launches again and raises there
    assert jvm.early_conf(config(), logging.INFO) is not None
