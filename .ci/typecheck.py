"""mypy over the package as a wheel lays it out (pyproject's [tool.mypy] says how strict, and where).

pyproject maps ``miles_fsm.states``, ``miles_fsm.drivers`` and ``miles_fsm.apps`` onto top-level
folders, and mypy cannot follow setuptools' editable finder, so the check runs on a tree of symbolic
links (``build/mypy-tree/``, git-ignored, made anew each run and kept so mypy's cache stays warm) in
which those folders sit where an installed wheel puts them, as tests/test_layers.py does for
import-linter. Usage: ``python .ci/typecheck.py [mypy options]``; exit status is mypy's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("states", "drivers", "apps")


def main() -> int:
    tree = ROOT / "build" / "mypy-tree"
    shutil.rmtree(tree, ignore_errors=True)
    pkg = tree / "miles_fsm"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "miles_fsm").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for layer in LAYERS:
        (pkg / layer).symlink_to(ROOT / layer, target_is_directory=True)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(ROOT / "build" / "mypy-cache"), "-p", "miles_fsm", *sys.argv[1:]]
    # Run from the tree, so findings name miles_fsm/states/... rather than a path outside the package.
    return subprocess.run(cmd, cwd=tree, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
