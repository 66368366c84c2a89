"""Type-check the installed package with mypy, as Python imports it.

The source folders map onto one import namespace (``model/`` is ``prism_tda.model``, see
pyproject.toml), which static tools cannot follow; this script lays the package out as Python sees
it (symbolic links under ``build/typecheck/``) and runs mypy there.

    python scripts/typecheck.py            # exit code of mypy
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = cfg["tool"]["setuptools"]["package-dir"]
    farm = ROOT / "build" / "typecheck"
    shutil.rmtree(farm, ignore_errors=True)
    for package, folder in sorted(mapping.items()):
        target = farm.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for f in (ROOT / folder).glob("*.py"):
            (target / f.name).symlink_to(f)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "prism_tda"]
    return subprocess.call(cmd, cwd=farm)


if __name__ == "__main__":
    sys.exit(main())
