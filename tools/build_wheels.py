"""Build a wheel of every distribution of this repository into one directory (`nox -s build`),
so they install on a machine without the clone: nothing is published to an index yet.

    python tools/build_wheels.py [DIR]    # default: dist/

Builds with `uv build` (offline first: the build backend is usually in uv's cache) and fails
unless every package under packages/ produced its wheel.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_wheels(out: Path) -> list[Path]:
    """One wheel per ``packages/*`` distribution in ``out``; their paths."""
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("uv is needed to build the wheels: pip install uv")
    wheels = []
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        stem = f"{project['name'].replace('-', '_')}-{project['version']}-"
        for offline in (["--offline"], []):  # online only when the cache lacks something
            cmd = [uv, "build", "-q", *offline, "--wheel", "--out-dir", str(out)]
            if subprocess.run([*cmd, str(pyproject.parent)], check=False).returncode == 0:
                break
        else:
            raise SystemExit(f"building {pyproject.parent.name} failed (output above)")
        wheels += [w for w in out.glob(f"{stem}*.whl")]
    return wheels


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else ROOT / "dist").resolve()
    for wheel in build_wheels(out):
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
