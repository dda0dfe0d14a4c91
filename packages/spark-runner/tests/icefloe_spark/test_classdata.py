"""The class-data cache (:mod:`icefloe_spark.runtime.classdata`) and the SPARK_HOME whose Python
processes import PySpark with bytecode caches (:mod:`icefloe_spark.runtime.sparkhome`). The archive
tests run a real ``java``: what is checked is what the JVM does with a file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from icefloe_spark.runtime import classdata, jvm, sparkhome

# a test that runs a JVM (`java -version` or Spark) is in the spark tier, not unit
needs_java = pytest.mark.skipif(classdata.java_binary() is None, reason="no java")


def fake_pyspark(root: Path) -> Path:
    target = root / "pyspark"
    for name in ("bin", "jars", "python/lib"):
        (target / name).mkdir(parents=True)
    (target / "python" / "lib" / "pyspark.zip").write_bytes(b"")
    (target / "__init__.py").write_text("")
    return target


def test_the_python_home_links_everything_but_the_zip(tmp_path: Path) -> None:
    target = fake_pyspark(tmp_path)
    home = sparkhome.python_home(target, tmp_path / "cache")
    assert sorted(p.name for p in home.iterdir()) == ["__init__.py", "bin", "jars"]
    assert (home / "bin").resolve() == (target / "bin").resolve()
    assert not (home / "python" / "lib" / "pyspark.zip").exists()
    assert sparkhome.python_home(target, tmp_path / "cache") == home  # made once


def test_the_python_home_follows_a_reinstalled_pyspark(tmp_path: Path) -> None:
    target = fake_pyspark(tmp_path)
    home = sparkhome.python_home(target, tmp_path / "cache")
    (target / "sbin").mkdir()  # another version, installed in the same place
    again = sparkhome.python_home(target, tmp_path / "cache")
    assert again == home
    assert (home / "sbin").is_symlink()
    assert [p.name for p in home.parent.iterdir()] == [home.name]  # nothing left over


def test_concurrent_callers_get_one_whole_python_home(tmp_path: Path) -> None:
    target = fake_pyspark(tmp_path)
    homes: list[Path] = []

    def make() -> None:
        homes.append(sparkhome.python_home(target, tmp_path / "cache"))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(homes)) == 1
    assert sorted(p.name for p in homes[0].iterdir()) == ["__init__.py", "bin", "jars"]
    assert [p.name for p in homes[0].parent.iterdir()] == [homes[0].name]


def test_a_spark_home_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_HOME", "/opt/spark")
    assert sparkhome.jvm_spark_home() is None


SPARK_PROBE = textwrap.dedent(
    """
    import sys
    from icefloe.config import config_from_dict
    from icefloe_spark.runtime import jvm
    from pyspark.sql.datasource import DataSource, DataSourceReader

    class Probe(DataSource):
        '''Its schema is decided in one of Spark's planner processes: it names where that
        process imported PySpark from.'''

        @classmethod
        def name(cls):
            return "probe"

        def schema(self):
            import pyspark
            return "zip_" + str(int(".zip" in pyspark.__file__)) + " int"

        def reader(self, schema):
            return ProbeReader()

    class ProbeReader(DataSourceReader):
        def read(self, partition):
            import pyspark
            yield (int(".zip" in pyspark.__file__),)

    config = config_from_dict({
        "name": "probe", "source": {"topics": ["t"]}, "tables": [{"name": "db.t"}],
        "catalog": {"properties": {"uri": "sqlite:///x.db"}},
        "spark": {"conf": {"spark.ui.enabled": "false"}, "class_data_cache": False},
    })
    spark = jvm.session(jvm.session_conf(config), "off")
    spark.dataSource.register(Probe)
    df = spark.read.format("probe").load()
    print("PLANNER", df.columns[0], "TASK", df.collect()[0][0], flush=True)
    spark.stop()
    """
)


@pytest.mark.spark
def test_spark_s_python_processes_import_pyspark_from_the_package_not_the_zip(
    tmp_path: Path,
) -> None:
    """A zip import compiles PySpark from source in every process Spark starts (1.2 s against
    0.4 s): a planner process (the data source's schema) and a task's worker both report
    where their PySpark came from, in a JVM launched as icefloe launches it."""
    env = {k: v for k, v in os.environ.items() if k != "SPARK_HOME"}
    env[sparkhome.CACHE_ENV] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, "-c", SPARK_PROBE],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("PLANNER"))
    assert line == "PLANNER zip_0 TASK 0", line


def archive(directory: Path, key: str, size: int) -> Path:
    path = directory / f"cds-{key}-{size}.jsa"
    path.write_bytes(b"x" * size)
    return path


def test_an_archive_whose_size_is_not_its_name_s_is_removed_not_used(tmp_path: Path) -> None:
    whole = archive(tmp_path, "k1", 100)
    assert classdata.find(tmp_path, "k1") == whole
    cut = tmp_path / "cds-k2-100.jsa"
    cut.write_bytes(b"x" * 60)  # as if truncated after it was kept
    assert classdata.find(tmp_path, "k2") is None
    assert not cut.exists()


def test_tidy_removes_dead_writes_and_old_archives_of_other_keys_only(tmp_path: Path) -> None:
    old = time.time() - classdata.UNUSED_S - 60
    dead = tmp_path / "cds-k1.123-ab.tmp"
    dead.write_bytes(b"")
    os.utime(dead, (old, old))
    writing = tmp_path / "cds-k1.124-cd.tmp"
    writing.write_bytes(b"")
    other = archive(tmp_path, "k0", 10)
    os.utime(other, (old, old))
    mine = archive(tmp_path, "k1", 10)
    os.utime(mine, (old, old))
    classdata._tidy(tmp_path, "k1", time.time())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([writing.name, mine.name])


def test_user_managed_class_data_is_left_alone() -> None:
    assert classdata.wanted({"spark.driver.extraJavaOptions": "-Dx=1"})
    for option in ("-Xshare:off", "-XX:SharedArchiveFile=/a.jsa", "-XX:ArchiveClassesAtExit=b"):
        assert not classdata.wanted({"spark.driver.extraJavaOptions": option})
    assert jvm._class_data({}, None, "off") is None


def dump(java: Path, into: Path) -> None:
    """A real (small) archive: the classes of ``java -version``."""
    options = classdata.Archive(into.parent, "k", java, write=into).java_options().split()
    subprocess.run([str(java), *options, "-version"], capture_output=True, check=True)


@pytest.mark.spark
@needs_java
def test_a_written_archive_is_checked_and_kept_under_its_size(tmp_path: Path) -> None:
    spark_home = fake_pyspark(tmp_path)
    cache = tmp_path / "cache"
    assert classdata.prepare(cache, spark_home) is None  # nothing kept, nothing to write
    plan = classdata.prepare(cache, spark_home, write=True)
    assert plan is not None
    assert plan.write is not None
    assert plan.read is None
    dump(plan.java, plan.write)
    kept = classdata.keep(plan, ".")
    assert kept is not None
    assert kept.stat().st_size == int(kept.stem.rsplit("-", 1)[1])
    assert not plan.write.exists()
    again = classdata.prepare(cache, spark_home, write=True)
    assert again is not None
    assert again.read == kept
    assert again.write is None
    assert "-XX:SharedArchiveFile=" in again.java_options()


@pytest.mark.spark
@needs_java
@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_written_archive_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A truncated archive crashes the JVM that maps it (SIGBUS); one with a flipped byte
    fails its checksum. Either is removed and nothing is kept, and the crash leaves no report
    in the working directory."""
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    spark_home = fake_pyspark(tmp_path)
    cache = tmp_path / "cache"
    plan = classdata.prepare(cache, spark_home, write=True)
    assert plan is not None
    assert plan.write is not None
    dump(plan.java, plan.write)
    data = bytearray(plan.write.read_bytes())
    if damage == "truncated":
        data = data[: len(data) * 2 // 3]
    else:
        data[len(data) * 2 // 3] ^= 0xFF
    plan.write.chmod(0o644)
    plan.write.write_bytes(bytes(data))
    assert classdata.keep(plan, ".") is None
    assert list(cache.iterdir()) == []
    assert list(workdir.iterdir()) == []


@pytest.mark.spark
@needs_java
def test_the_first_writer_kept_wins(tmp_path: Path) -> None:
    spark_home = fake_pyspark(tmp_path)
    cache = tmp_path / "cache"
    first = classdata.prepare(cache, spark_home, write=True)
    second = classdata.prepare(cache, spark_home, write=True)
    assert first is not None
    assert second is not None
    assert first.write != second.write
    assert first.write is not None
    assert second.write is not None
    dump(first.java, first.write)
    shutil.copy(first.write, second.write)
    kept = classdata.keep(first, ".")
    assert kept is not None
    assert classdata.keep(second, ".") == kept
    assert [p.name for p in cache.iterdir()] == [kept.name]


def test_an_unusable_cache_directory_costs_speed_not_the_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a writable cache PySpark's own SPARK_HOME holds and no class data is used."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.delenv("SPARK_HOME", raising=False)
    monkeypatch.setenv(sparkhome.CACHE_ENV, str(blocked / "cache"))
    assert sparkhome.jvm_spark_home() is None
    assert classdata.prepare(blocked / "class-data", fake_pyspark(tmp_path), write=True) is None
