"""One logging set-up for every long-running command (``run``, ``coordinator``, ``status``,
``doctor``): a single level chosen by ``--log-level`` / ``-v`` / ``-q``, text or JSON lines.

JSON lines exist because services run without a terminal (systemd, containers, files): a log
shipper can parse them, and progress is one line per commit cycle instead of a live view.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

if TYPE_CHECKING:
    from rich.console import Console

LogFormat = Literal["text", "json"]
LEVELS = ("debug", "info", "warning", "error")

LogLevelOption = Annotated[
    str | None,
    typer.Option(
        "--log-level",
        help="Log level: debug, info, warning or error (default: info).",
        show_default=False,
    ),
]
VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Debug logging (Spark's and Java's too).")
]
LogFormatOption = Annotated[
    str, typer.Option("--log-format", help="Log lines as 'text' or 'json' (one object a line).")
]
# attributes every LogRecord has; anything else was passed through ``extra=`` and is a field
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}


def resolve_level(level: str | None, verbose: bool = False, quiet: bool = False) -> int:
    """The numeric level from the three options; ``--log-level`` wins over ``-v``/``-q``."""
    from icefloe.errors import ConfigError

    if level is not None:
        name = level.strip().lower()
        if name not in LEVELS:
            raise ConfigError(
                "--log-level", "unknown level", f"use one of {', '.join(LEVELS)}", level
            )
        return int(getattr(logging, name.upper()))
    if verbose:
        return logging.DEBUG
    if quiet:
        return logging.WARNING
    return logging.INFO


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message and every ``extra`` field."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class ConsoleHandler(logging.Handler):
    """Log lines printed by a rich console, whole (the terminal wraps them, not rich), so a
    live view on that console draws itself below them."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        from rich.text import Text

        try:
            self.console.print(Text(self.format(record)), soft_wrap=True)
        except Exception:
            self.handleError(record)


def check_format(fmt: str) -> LogFormat:
    from icefloe.errors import ConfigError

    if fmt not in ("text", "json"):
        raise ConfigError("--log-format", "unknown format", "use 'text' or 'json'", fmt)
    return "json" if fmt == "json" else "text"


# the committer's line per table and the coordinator's per cycle: what `icefloe run` says in
# its own words (one line per table commit, one a minute), so it leaves these to -v
DETAIL_LOGGERS = ("icefloe.committer", "icefloe.coordinator.cycles")


def configure(
    level: int, fmt: str = "text", *, details: bool = True, console: Console | None = None
) -> None:
    """Route every logger to stderr at ``level``; third-party chatter stays at WARNING unless
    debugging (py4j logs every gateway call at INFO), and so do :data:`DETAIL_LOGGERS` unless
    ``details``. Text lines go through ``console`` when it is a terminal: a live view drawn
    on it keeps them above itself, where lines written past it would garble the view."""
    handler: logging.Handler
    if check_format(fmt) == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    else:
        on_terminal = console is not None and console.is_terminal
        handler = ConsoleHandler(console) if console and on_terminal else logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    noisy = ("py4j", "pyiceberg", "urllib3", "botocore", "asyncio")
    for name in noisy if details else (*noisy, *DETAIL_LOGGERS):
        logging.getLogger(name).setLevel(level if level <= logging.DEBUG else logging.WARNING)
    if details:
        for name in DETAIL_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
