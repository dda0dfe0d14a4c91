"""Keep every package's version and internal pins equal to the root VERSION file.

    python tools/bump_version.py          # rewrite packages/*/pyproject.toml from VERSION
    python tools/bump_version.py 0.2.0    # write VERSION first, then rewrite

Hand-written (a few regexes) so the rewrite keeps each pyproject.toml's comments and layout.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PROJECT_VERSION = re.compile(r'(?m)^version = "[^"]*"')
_INTERNAL_PIN = re.compile(r'"(icefloe-[a-z-]+(?:\[[^\]]*\])?)==[^";]*')


def rewrite(text: str, version: str) -> str:
    """``text`` with its project version and every ``icefloe-*==`` pin set to ``version``."""
    text = _PROJECT_VERSION.sub(f'version = "{version}"', text, count=1)
    return _INTERNAL_PIN.sub(lambda m: f'"{m[1]}=={version}', text)


def main(argv: list[str]) -> int:
    version_file = ROOT / "VERSION"
    if argv:
        version_file.write_text(argv[0].strip() + "\n")
    version = version_file.read_text().strip()
    for path in sorted(ROOT.glob("packages/*/pyproject.toml")):
        old = path.read_text()
        new = rewrite(old, version)
        if new != old:
            path.write_text(new)
            print(f"{path.relative_to(ROOT)}: {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
