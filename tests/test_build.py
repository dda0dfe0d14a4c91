"""`nox -s build` (tools/build_wheels.py): wheels of all five distributions, which install on
a machine without this tree."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheels_of_every_distribution_install_from_files(tmp_path: Path) -> None:
    names = {
        tomllib.loads(p.read_text())["project"]["name"].replace("-", "_")
        for p in ROOT.glob("packages/*/pyproject.toml")
    }
    assert len(names) == 5, names
    tool = [sys.executable, str(ROOT / "tools/build_wheels.py"), str(tmp_path / "dist")]
    printed = subprocess.run(tool, capture_output=True, text=True, check=True).stdout.split()
    wheels = sorted((tmp_path / "dist").glob("*.whl"))
    assert {w.name.split("-")[0] for w in wheels} == names
    assert printed == [str(w) for w in wheels]
    # another machine: a fresh environment, the wheels and the package index (here, its cache)
    env = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", str(env), "-p", sys.executable], check=True)
    python = env / "bin" / "python"
    wanted = ["--find-links", str(tmp_path / "dist"), "icefloe-core", "icefloe-backend-redis"]
    install = ["uv", "pip", "install", "-q", "--python", str(python), *wanted]
    # the index's cache first; online when a dependency has a release newer than the cache
    # holds (python-dateutil 4.0.0 appeared on PyPI while every cached venv had 2.x), as the
    # nox sessions install (cwd: not the tree, the files alone)
    offline = subprocess.run([*install, "--offline"], cwd=tmp_path, check=False)
    if offline.returncode:
        subprocess.run(install, cwd=tmp_path, check=True)
    out = subprocess.run(
        [str(python), "-m", "icefloe", "backends"], capture_output=True, text=True, check=True
    )
    assert [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("backend")] == [
        "redis"
    ], out.stdout
