"""The API reference (mkdocs.yml, docs/api/) builds with warnings as errors and documents every public name.

"Every public name" is each name of the ``__all__`` of every public package
(every package under ``miles_fsm`` but the CLI's ``apps``) and of the two
public modules, ``miles_fsm.errors`` and ``miles_fsm.config``. A name counts
as documented when the built site's ``objects.inv`` (the inventory
mkdocstrings writes for every object it rendered) holds ``package.name``.

The site is built here with ``mkdocs build --strict``. ``.ci/run`` has just
built it from the same tree (into ``site/``) and says so in
``MILES_FSM_API_SITE``; the test then reads that build instead of making a
second one.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11 or later reads pyproject.toml")

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = ("miles_fsm.errors", "miles_fsm.config")

pytest.importorskip("mkdocstrings", reason="the API reference needs the 'docs' extra: pip install -e '.[docs]'")

pytestmark = pytest.mark.slow


def public_packages() -> list[str]:
    # pyproject's list, which is what a wheel installs: the editable install maps states/ and
    # drivers/ in through an import hook, so walking ``miles_fsm.__path__`` would miss them.
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return [name for name in listed if not name.startswith("miles_fsm.apps")]


def inventory(site: Path) -> set[str]:
    """The object names of a Sphinx ``objects.inv`` (version 2: four header lines, then zlib)."""
    raw = (site / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = raw.index(b"\n", header_end) + 1
    lines = zlib.decompress(raw[header_end:]).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = os.environ.get("MILES_FSM_API_SITE")
    if built:
        return ROOT / built
    out = tmp_path_factory.mktemp("api") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_public_packages_are_found() -> None:
    # the mapped folders (states/, drivers/) must be among them, or the check below checks nothing of them
    packages = public_packages()
    for name in packages:
        importlib.import_module(name)
    for expected in ("miles_fsm.states", "miles_fsm.drivers", "miles_fsm.drivers.megatron",
                     "miles_fsm.drivers.sglang", "miles_fsm.drivers.reference", "miles_fsm.trace",
                     "miles_fsm.replay", "miles_fsm.guard", "miles_fsm.aio", "miles_fsm.launch"):
        assert expected in packages


@pytest.mark.parametrize("module", [*public_packages(), *PUBLIC_MODULES])
def test_every_public_name_is_in_the_reference(site: Path, module: str) -> None:
    documented = inventory(site)
    assert module in documented, f"{module} has no page: add docs/api/<page>.md holding '<!-- api: {module} -->'"
    names = importlib.import_module(module).__all__
    assert names, f"{module}.__all__ is empty"
    missing = sorted(name for name in names if f"{module}.{name}" not in documented)
    assert not missing, f"{module}.__all__ names missing from the API reference: {missing}"


def test_the_launchers_and_the_async_snapshot_show_their_signatures(site: Path) -> None:
    # what an embedder had to read the source for (issue 25)
    launch = (site / "launch" / "index.html").read_text()
    for name in ("run_ranks", "run_ranks_ray", "run_under_torchrun"):
        assert f'id="miles_fsm.launch.{name}"' in launch
    assert "timeout_s" in launch and "pg_timeout_s" in launch  # run_ranks's keyword parameters
    assert 'id="miles_fsm.launch.RankOutcome"' in launch
    aio = (site / "aio" / "index.html").read_text()
    assert 'id="miles_fsm.aio.AsyncSnapshot"' in aio
