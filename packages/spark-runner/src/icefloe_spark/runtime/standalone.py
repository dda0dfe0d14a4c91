"""A throwaway Spark standalone cluster on 127.0.0.1, started from the PySpark wheel itself.

The wheel is a complete Spark distribution (``bin/spark-class``, ``jars/``), so a master and
workers need nothing else installed. With such a cluster the executors run in JVMs and
Python workers of their own, apart from the driver's, which is what the cluster test and
``bench_e2e.py --cluster`` need; nothing here is meant for production clusters.

    with standalone_cluster(workdir, workers=2) as cluster:
        config["spark"]["master"] = cluster.master_url
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from icefloe_spark.runtime import sparkhome

#: enough for three JVMs to start on a loaded 2-core machine
DEFAULT_START_TIMEOUT_S = 180.0
_LOG_TAIL_CHARS = 4000
#: each worker's scratch directory, inside its work dir
SCRATCH = "scratch"


class ClusterStartError(RuntimeError):
    """The master or a worker exited, or the workers were not ALIVE in time; the message
    holds the tail of each process's output."""


@dataclass(frozen=True)
class StandaloneCluster:
    """A running cluster. ``worker_dirs[i]`` is worker i's ``--work-dir``: each executor
    logs to ``<work-dir>/<app-id>/<executor-id>/stderr`` there, and keeps its scratch
    (``SPARK_LOCAL_DIRS``, ``TMPDIR``) in ``<work-dir>/scratch``, so no two workers share a
    local directory, as on machines of their own. ``pids`` are the master's and workers'
    JVMs (executors and their Python workers are the workers' children)."""

    master_url: str
    ui_url: str
    worker_dirs: tuple[Path, ...]
    pids: tuple[int, ...]


def alive_workers(ui_url: str) -> int:
    """Workers the master reports ALIVE, from its web UI's JSON (``/json/``)."""
    with urllib.request.urlopen(f"{ui_url}/json/", timeout=5) as response:
        state = json.loads(response.read())
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


def _env(home: Path, logs: Path, python: str) -> dict[str, str]:
    """The caller's environment minus its SPARK_CONF_DIR, so Spark's defaults hold (executors
    then log each task at INFO to their stderr file, which the cluster test counts)."""
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONF_DIR"}
    env.update(
        SPARK_HOME=str(home),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(logs),
        # executors' Python workers must import icefloe: an interpreter that has it
        PYSPARK_PYTHON=python,
    )
    return env


def _tails(paths: list[Path]) -> str:
    return "\n".join(
        f"--- {p}\n{p.read_text(errors='replace')[-_LOG_TAIL_CHARS:]}" for p in paths if p.exists()
    )


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each process's group: spark-class execs the JVM in the group it was started
    in, and a worker's executors and their Python workers inherit it."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait(60)


@contextmanager
def standalone_cluster(
    workdir: Path,
    workers: int = 2,
    cores: int = 1,
    memory: str = "1g",
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    python: str = sys.executable,
) -> Iterator[StandaloneCluster]:
    """Start a master and ``workers`` workers of ``cores`` cores and ``memory`` each (Spark's
    size syntax: ``"1g"``, ``"512m"``) under ``workdir``; yield once the master reports every
    worker ALIVE; kill them all on exit. Raises :class:`ClusterStartError` when they do not
    come up. ``python`` is the executors' Python (``PYSPARK_PYTHON``)."""
    # executors' Python workers import PySpark with bytecode caches, as the driver's do
    home = Path(sparkhome.jvm_spark_home() or sparkhome.pyspark_home())
    spark_class = str(home / "bin" / "spark-class")
    workdir.mkdir(parents=True, exist_ok=True)
    env = _env(home, workdir / "logs", python)
    port, ui_port = _free_port(), _free_port()
    master_url = f"spark://127.0.0.1:{port}"
    ui_url = f"http://127.0.0.1:{ui_port}"
    procs: list[subprocess.Popen[bytes]] = []
    outs: list[Path] = []

    def launch(name: str, *args: str, scratch: Path | None = None) -> None:
        out = workdir / f"{name}.out"
        outs.append(out)
        own = env
        if scratch is not None:  # a worker's executors inherit it, and so do their Pythons
            scratch.mkdir(exist_ok=True)
            own = {**env, "SPARK_LOCAL_DIRS": str(scratch), "TMPDIR": str(scratch)}
        with out.open("wb") as f:  # the child keeps its own copy of the descriptor
            procs.append(
                subprocess.Popen(
                    [spark_class, *args],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=own,
                    cwd=workdir,
                    start_new_session=True,  # a group of its own, killed as a whole
                )
            )

    worker_dirs = tuple(workdir / f"worker{i}" for i in range(1, workers + 1))
    try:
        launch(
            "master",
            "org.apache.spark.deploy.master.Master",
            *("--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui_port)),
        )
        for i, work in enumerate(worker_dirs, 1):
            work.mkdir(exist_ok=True)
            launch(
                f"worker{i}",
                "org.apache.spark.deploy.worker.Worker",
                master_url,
                *("--host", "127.0.0.1", "--cores", str(cores), "--memory", memory),
                *("--webui-port", str(_free_port()), "--work-dir", str(work)),
                scratch=work / SCRATCH,
            )
        _wait_alive(procs, outs, ui_url, workers, start_timeout_s)
        yield StandaloneCluster(master_url, ui_url, worker_dirs, tuple(p.pid for p in procs))
    finally:
        _kill(procs)


def _free_port() -> int:
    """A port of 127.0.0.1 that no one listened on a moment ago: Spark's daemons take a port
    number to bind themselves, not a bound socket."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        return int(server.getsockname()[1])


def _wait_alive(
    procs: list[subprocess.Popen[bytes]],
    outs: list[Path],
    ui_url: str,
    workers: int,
    timeout_s: float,
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        dead = [(p.args, p.returncode) for p in procs if p.poll() is not None]
        if dead:
            raise ClusterStartError(f"a Spark cluster process exited: {dead}\n{_tails(outs)}")
        try:
            if alive_workers(ui_url) == workers:
                return
        except OSError:
            pass  # the master's UI is not up yet
        if time.monotonic() > deadline:
            raise ClusterStartError(
                f"{workers} Spark workers were not ALIVE at {ui_url} after {timeout_s:.0f}s\n"
                f"{_tails(outs)}"
            )
        time.sleep(1.0)
