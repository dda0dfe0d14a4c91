"""Spark's classes archived once per machine (Java's AppCDS), so later driver JVMs start fast.

Measured here (docs/benchmarks.md, start-up): with an archive of the classes a driver JVM
loaded, a session starts in 2.5-3.5 s instead of 8 s, and the JVM uses 4-8 CPU s instead of
20 to its first job. Java writes the archive itself (``-XX:ArchiveClassesAtExit``) when a JVM
that had none exits; icefloe chooses where, and makes it safe to share:

* A JVM maps the archive into memory, and a truncated one kills it (SIGBUS) rather than being
  refused. So a JVM writes under a name of its own; once it has exited, another JVM checks
  every region's checksum (``-Xshare:on -XX:+VerifySharedSpaces``, 0.2 s) and only then is the
  file linked into place, under a name that holds its size: a file whose size differs from
  its name's is never used, and is removed.
* The name also holds a key: the java binary, the SPARK_HOME and the extra class path. A JVM
  refuses (and silently ignores) an archive written by another JVM or for another class path,
  so a change of any of them makes a new archive rather than losing the speed for good.
* Only ``icefloe run`` and ``icefloe demo`` write one (they end the JVM and keep the file,
  ~150 MB); every JVM icefloe launches uses one that exists. Concurrent writers: the first one
  kept wins. ``spark.class_data_cache = false`` turns all of it off.

Stdlib only: the JVM is launched before the rest of the runner is imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("icefloe_spark.classdata")

#: options that mean the user manages class data sharing themselves
USER_CDS_OPTIONS = ("-Xshare", "SharedArchiveFile", "ArchiveClassesAtExit")
#: a JVM writes its archive in about 10 s as it exits; an unfinished file older than this is
#: left from a process that died and is removed
STALE_WRITE_S = 15 * 60
#: archives of another key (an older java or pyspark) not used for this long are removed
UNUSED_S = 30 * 24 * 3600
VERIFY_TIMEOUT_S = 120.0
_PREFIX = "cds-"
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"  # its warnings go to stdout, lines per class


def java_binary() -> Path | None:
    """The java Spark's launcher runs: ``$JAVA_HOME/bin/java``, else the first on PATH."""
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not found or not os.path.exists(found):
        return None
    return Path(found).resolve()


def archive_key(java: Path, spark_home: Path, extra_class_path: str) -> str:
    """What an archive fits: this java build, these Spark jars, this extra class path."""
    digest = hashlib.sha256()
    stat = java.stat()
    digest.update(f"{java}\0{stat.st_size}\0{stat.st_mtime_ns}\0{spark_home}\0".encode())
    jars = spark_home / "jars"
    for jar in sorted(jars.iterdir()) if jars.is_dir() else ():
        digest.update(f"{jar.name}\0{jar.stat().st_size}\0".encode())
    digest.update(extra_class_path.encode())
    return digest.hexdigest()[:20]


@dataclass(frozen=True)
class Archive:
    """One JVM's use of the cache: the archive it maps (``read``) or the file it writes as it
    exits (``write``), never both (Java 17 cannot extend an archive it runs with)."""

    directory: Path
    key: str
    java: Path
    read: Path | None = None
    write: Path | None = None

    def java_options(self) -> str:
        if self.read is not None:
            return f"-XX:SharedArchiveFile={self.read} {_QUIET}"
        if self.write is not None:
            # the checksums are computed as it writes, so that keep() can check them
            return f"-XX:ArchiveClassesAtExit={self.write} -XX:+VerifySharedSpaces {_QUIET}"
        return ""


def _size_in_name(path: Path) -> int | None:
    try:
        return int(path.stem.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return None


def find(directory: Path, key: str) -> Path | None:
    """The kept archive for ``key``, if one is whole; one that is not is removed."""
    for path in directory.glob(f"{_PREFIX}{key}-*.jsa"):
        try:
            whole = path.stat().st_size == _size_in_name(path)
        except OSError:
            continue
        if whole:
            return path
        log.warning("removing class-data archive %s: its size is not the one it was kept at", path)
        with contextlib.suppress(OSError):
            path.unlink()
    return None


def _tidy(directory: Path, key: str, now: float) -> None:
    """Remove unfinished writes of dead processes and archives of other keys left unused."""
    for path in directory.glob(f"{_PREFIX}*"):
        try:
            age = now - path.stat().st_mtime
        except OSError:
            continue
        unfinished = path.suffix == ".tmp" and age > STALE_WRITE_S
        unused = (
            path.suffix == ".jsa" and not path.name.startswith(_PREFIX + key) and age > UNUSED_S
        )
        if unfinished or unused:
            with contextlib.suppress(OSError):
                path.unlink()


def prepare(
    directory: Path, spark_home: Path, extra_class_path: str = "", write: bool = False
) -> Archive | None:
    """This JVM's archive: the kept one (its mtime refreshed: it is in use), else, if
    ``write``, a new file of its own to write at exit. None without java or a usable
    directory, or when there is nothing to read and nothing to write."""
    java = java_binary()
    if java is None:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        key = archive_key(java, spark_home, extra_class_path)
        now = time.time()
        _tidy(directory, key, now)
        kept = find(directory, key)
        if kept is not None:
            os.utime(kept, (now, now))
            return Archive(directory, key, java, read=kept)
    except OSError as exc:
        log.debug("no class-data cache in %s: %s", directory, exc)
        return None
    if not write:
        return None
    name = f"{_PREFIX}{key}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    return Archive(directory, key, java, write=directory / name)


def verify(java: Path, archive: Path, class_path: str) -> bool:
    """Whether a JVM with ``class_path`` maps ``archive`` and every region's checksum holds."""
    command = [str(java), "-Xshare:on", f"-XX:SharedArchiveFile={archive}"]
    command += ["-XX:+VerifySharedSpaces", "-cp", class_path]
    # a damaged archive crashes this JVM: no crash report in the user's working directory
    command += ["-XX:ErrorFile=/dev/null", "-XX:-CreateCoredumpOnCrash", "-version"]
    try:
        done = subprocess.run(command, capture_output=True, timeout=VERIFY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("could not check class-data archive %s: %s", archive, exc)
        return False
    if done.returncode != 0:
        first = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()[:1]
        log.warning(
            "class-data archive %s failed its check (exit %s%s); not kept",
            archive,
            done.returncode,
            f": {first[0]}" if first else "",
        )
    return done.returncode == 0


def keep(archive: Archive, class_path: str) -> Path | None:
    """After the JVM exited: check the file it wrote and link it into place under its size;
    remove the written file either way. The kept path, or None."""
    written = archive.write
    if written is None or not written.exists():
        return None
    try:
        size = written.stat().st_size
        final = archive.directory / f"{_PREFIX}{archive.key}-{size}.jsa"
        if size == 0 or not verify(archive.java, written, class_path):
            return None
        try:
            os.link(written, final)  # never replaces: a concurrent writer's kept one stays
        except FileExistsError:
            return final
        log.info("kept the JVM's class data (%.0f MB) at %s for later starts", size / 1e6, final)
        return final
    except OSError as exc:
        log.warning("could not keep class-data archive %s: %s", written, exc)
        return None
    finally:
        with contextlib.suppress(OSError):
            written.unlink()


def wanted(conf: Mapping[str, str]) -> bool:
    """Whether icefloe should manage class data for a JVM with these settings: not when the
    driver's Java options already manage it."""
    options = conf.get("spark.driver.extraJavaOptions", "")
    return not any(option in options for option in USER_CDS_OPTIONS)
