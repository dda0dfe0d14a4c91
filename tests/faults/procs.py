"""Process trees of the fault suite: start them in their own session, kill all of them.

``icefloe run`` starts a JVM, which starts Python workers and daemons; ``kill -9`` of the driver
alone leaves those running (an orphaned JVM keeps writing files). Every process the suite
starts carries a marker in its environment, which its descendants inherit, so the whole tree is
found even when a member left the process group; psutil does the walking (portable, kept up).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import psutil

MARKER_ENV = "ICEFLOE_FAULTS_RUN"


class Tree:
    """One started command and every process descended from it."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str], run: str) -> None:
        # this tree's own marker; ``run:`` prefixes it so a whole run's leftovers are found too
        self.marker = f"{run}:{uuid.uuid4().hex[:8]}"
        self.log = log
        self.log_offset = log.stat().st_size if log.exists() else 0  # where its output starts
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**env, MARKER_ENV: self.marker},
                start_new_session=True,  # its own process group: killpg reaches the JVM too
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def members(self) -> list[psutil.Process]:
        """The root, its descendants and anything else carrying this tree's marker."""
        found: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.pid)
            found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
        except psutil.NoSuchProcess:
            pass
        for p in marked(self.marker):
            found.setdefault(p.pid, p)
        return list(found.values())

    def signal_all(self, sig: signal.Signals) -> int:
        """Send ``sig`` to the process group and to every member; how many were signalled."""
        members = self.members()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        for p in members:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        return len(members)

    def kill(self, timeout: float = 30.0) -> None:
        """``kill -9`` of the whole tree, then wait until none of it is left."""
        deadline = time.monotonic() + timeout
        while True:
            self.signal_all(signal.SIGKILL)
            if self.alive():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(1)
            left = [p for p in self.members() if _running(p)]
            if not left and not self.alive():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes survived kill -9: {[p.pid for p in left]}")
            time.sleep(0.2)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (a clean stop), then kill whatever is left; the root's exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        code = self.proc.poll()
        self.kill()
        return code

    def committers(self) -> list[psutil.Process]:
        """The committer processes (``coordination.commit_processes``) of the coordinator this
        tree's root runs: its children started by multiprocessing's spawn (the resource
        tracker, also spawned, runs another entry point; Spark's Python workers are the
        JVM's children)."""
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in children:
            try:
                if "spawn_main" in " ".join(p.cmdline()) and _running(p):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def python_workers(self) -> list[psutil.Process]:
        """Spark's Python workers in this tree: the processes ``pyspark.daemon`` forks for
        tasks (a sink task, or a commit task with ``spark.commit_tasks``), not the daemon."""
        out = []
        for p in self.members():
            try:
                parent = p.parent()
                if (
                    parent is not None
                    and "pyspark.daemon" in " ".join(p.cmdline())
                    and "pyspark.daemon" in " ".join(parent.cmdline())
                    and _running(p)
                ):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def pause(self) -> None:
        self.signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal_all(signal.SIGCONT)


def _running(p: psutil.Process) -> bool:
    try:
        return bool(p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def marked(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``marker``, or a tree marker of run
    ``marker`` (ours: one user)."""
    out = []
    for p in psutil.process_iter():
        try:
            found = p.environ().get(MARKER_ENV, "")
            if (found == marker or found.startswith(f"{marker}:")) and _running(p):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out
