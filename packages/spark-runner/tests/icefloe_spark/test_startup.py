"""What keeps start-up short (docs/benchmarks.md, start-up)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# what only the write tasks need: pyiceberg's catalog and Parquet writer, the converter
TASK_ONLY = ("pyiceberg.catalog", "pyiceberg.io.pyarrow", "icefloe.convert", "icefloe.coordinator")


@pytest.mark.parametrize("module", ["icefloe_spark.sink", "icefloe_spark.source"])
def test_modules_spark_planners_import_leave_the_task_only_parts_out(module: str) -> None:
    """Spark imports these in a fresh process for each planning step of a query and for the
    sink's commit; the parts only write tasks use load when a task uses them."""
    code = f"import sys, {module}; print(sorted(m for m in {TASK_ONLY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
