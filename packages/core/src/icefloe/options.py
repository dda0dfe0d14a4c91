"""Command-line options that core's and plugins' commands share (``--metrics-port``), in a
module of their own: a command that serves no metrics (``icefloe status``) then does not
import prometheus-client with them. ``icefloe.metrics`` re-exports them where they were."""

from __future__ import annotations

from typing import Annotated

import typer

MetricsPortOption = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        min=0,
        max=65535,
        help="Serve Prometheus metrics on this port (all interfaces; 0: pick a free one).",
        show_default=False,
    ),
]
