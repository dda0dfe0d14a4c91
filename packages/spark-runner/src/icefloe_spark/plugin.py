"""icefloe plugin entry point (hook implementations): the Spark runner's CLI commands."""

from __future__ import annotations

from typing import Any

from icefloe.hookspecs import hookimpl


@hookimpl
def icefloe_cli(app: Any) -> None:
    """Add ``icefloe run`` and ``icefloe demo``; Spark is imported only when they run."""
    from icefloe_spark.cli import register

    register(app)
