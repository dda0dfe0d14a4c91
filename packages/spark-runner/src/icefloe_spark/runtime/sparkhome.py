"""A SPARK_HOME whose Python processes import PySpark with bytecode caches, and icefloe's cache
directory that holds it.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on the path of every Python process it
starts (each step of a Python data source's life, the task workers' daemon, the sink's commit
runner: ten before a pipeline's first commit, and one more per micro-batch). Python keeps no
bytecode cache for modules it imports from a zip, so every one of them compiled PySpark from
source: 1.2 s to import PySpark's worker modules against 0.4 s from the installed package,
measured here (docs/benchmarks.md, start-up). pip's ``pyspark`` package is a whole SPARK_HOME
whose modules are also installed as the package itself, so the JVM gets a directory that
links to every part of it but ``python/``: the zip is then missing from the workers' path
(Python skips entries that do not exist) and they import the installed package, whose
bytecode caches they write once. A SPARK_HOME the user set is left as it is. Stdlib only:
``icefloe run`` calls this before it imports the rest of the runner.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

CACHE_ENV = "ICEFLOE_CACHE_DIR"
SPARK_HOME_ENV = "SPARK_HOME"
_SKIPPED = "python"  # holds lib/pyspark.zip (and the shell's startup file)


def cache_dir() -> Path:
    """``$ICEFLOE_CACHE_DIR``, else ``$XDG_CACHE_HOME/icefloe``, else ``~/.cache/icefloe``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "icefloe")


def pyspark_home() -> Path:
    """The installed pyspark package, which is a whole SPARK_HOME."""
    import importlib.util

    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("pyspark is not installed")
    return Path(spec.origin).parent


def _linked(home: Path, target: Path) -> bool:
    """Whether ``home`` links every entry of ``target`` but ``python/``, to that entry."""
    try:
        wanted = {e.name for e in target.iterdir() if e.name != _SKIPPED}
        have = {e.name: e for e in home.iterdir()}
    except OSError:
        return False
    return set(have) == wanted and all(
        e.is_symlink() and os.readlink(e) == str(target / e.name) for e in have.values()
    )


def python_home(target: Path | None = None, cache: Path | None = None) -> Path:
    """A SPARK_HOME under the cache directory that links to every entry of ``target`` (the
    installed pyspark package) but ``python/``, made once per installation. Built under a
    temporary name and renamed into place, so concurrent callers never see a partial one."""
    target = (target or pyspark_home()).resolve()
    digest = hashlib.sha256(str(target).encode()).hexdigest()[:16]
    root = (cache or cache_dir()) / "spark-home"
    home = root / digest
    if _linked(home, target):
        return home
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f"{digest}.", dir=root))
    for entry in target.iterdir():
        if entry.name != _SKIPPED:
            (building / entry.name).symlink_to(target / entry.name)
    try:
        os.rename(building, home)
    except OSError:  # another process made it meanwhile, or an outdated one is in the way
        if not _linked(home, target):  # pyspark was reinstalled there: replace it
            stale = root / f"{building.name}.stale"
            with contextlib.suppress(OSError):
                os.rename(home, stale)
            with contextlib.suppress(OSError):
                os.rename(building, home)
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(building, ignore_errors=True)
    return home


def jvm_spark_home() -> str | None:
    """The SPARK_HOME to launch Spark's JVM with: None when the user set one (theirs holds),
    else :func:`python_home` for the installed package, or None if that cannot be made (then
    PySpark's own choice holds, which only costs start-up time)."""
    if os.environ.get(SPARK_HOME_ENV):
        return None
    try:
        return str(python_home())
    except OSError:
        return None
