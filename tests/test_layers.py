"""One-way layers, checked by import-linter: engine < states < drivers < apps.

pyproject maps ``miles_fsm.states``, ``miles_fsm.drivers`` and
``miles_fsm.apps`` onto top-level folders, so the installed package has no
such folders under ``miles_fsm/`` and import-linter (through grimp, which
walks the package's directory) would see none of their modules. The test
lays out the package as an installed wheel would, in a temporary tree of
symbolic links, and runs ``lint-imports`` on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("states", "drivers", "apps")

pytest.importorskip("importlinter", reason="the layer check needs import-linter (the 'test' extra installs it)")


def _engine_modules() -> list[str]:
    """Every module of the engine, its packages' included (a glob of ``miles_fsm/*.py`` alone would leave
    the modules of ``miles_fsm/replay/``, ``trace/`` and the others out of the contract)."""
    out = []
    for p in (ROOT / "miles_fsm").rglob("*.py"):
        parts = p.relative_to(ROOT / "miles_fsm").with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out.append(".".join(("miles_fsm", *parts)))
    return sorted(out)


def _tree(tmp: Path) -> Path:
    """``miles_fsm/`` with the mapped folders linked in where a wheel would put them."""
    pkg = tmp / "site" / "miles_fsm"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "miles_fsm").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for layer in LAYERS:
        (pkg / layer).symlink_to(ROOT / layer, target_is_directory=True)
    return pkg.parent


def _config(tmp: Path, extra: tuple[str, ...]) -> Path:
    engine = "".join(f"    {m}\n" for m in [*_engine_modules(), *extra])
    text = f"""[importlinter]
root_package = miles_fsm
# The facade's TYPE_CHECKING imports exist for type checkers only; its names resolve lazily.
exclude_type_checking_imports = True
# torch is an external package: the replay contract forbids it.
include_external_packages = True

[importlinter:contract:engine]
name = the engine (miles_fsm/*.py) imports no layer above it
type = forbidden
source_modules =
{engine}forbidden_modules =
    miles_fsm.states
    miles_fsm.drivers
    miles_fsm.apps

[importlinter:contract:states]
name = the lifecycle (states/) imports neither the drivers nor the apps
type = forbidden
source_modules =
    miles_fsm.states
forbidden_modules =
    miles_fsm.drivers
    miles_fsm.apps

[importlinter:contract:trace]
name = the trace writer (miles_fsm.trace) never imports the reader (miles_fsm.replay)
type = forbidden
source_modules =
    miles_fsm.trace
forbidden_modules =
    miles_fsm.replay

[importlinter:contract:replay]
name = replay (miles_fsm.replay) never imports torch: reading traces runs where torch is not installed
type = forbidden
source_modules =
    miles_fsm.replay
forbidden_modules =
    torch
# A live rank's Flight Recorder capture (``flight_recorder._raw``) imports torch inside the function;
# replay only reads dumps from files.
ignore_imports =
    miles_fsm.flight_recorder -> torch
# torch's own Flight Recorder analyzer (torch.distributed.flight_recorder), imported inside the functions
# that align torch-format dumps, only when such dumps are read: replay of traces alone still needs no torch.
    miles_fsm.replay.fr_groups -> torch
    miles_fsm.replay.fr_native -> torch

[importlinter:contract:drivers]
name = the drivers (drivers/) do not import the apps
type = forbidden
source_modules =
    miles_fsm.drivers
forbidden_modules =
    miles_fsm.apps
"""
    path = tmp / "importlinter.ini"
    path.write_text(text)
    return path


def _lint(tmp: Path, site: Path, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [str(lint), "--config", str(_config(tmp, extra)), "--no-cache"],
        capture_output=True, text=True, env=env, cwd=tmp, timeout=120,
    )  # fmt: skip


def test_the_import_graph_sees_every_layer(tmp_path):
    """grimp finds modules of all four layers in the linked tree (else the contracts would pass vacuously)."""
    import grimp

    site = _tree(tmp_path)
    sys.path.insert(0, str(site))
    saved = {k: v for k, v in sys.modules.items() if k == "miles_fsm" or k.startswith("miles_fsm.")}
    try:
        for k in saved:
            del sys.modules[k]
        graph = grimp.build_graph("miles_fsm", cache_dir=None)
    finally:
        sys.path.remove(str(site))
        for k in [k for k in sys.modules if k == "miles_fsm" or k.startswith("miles_fsm.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    modules = graph.modules
    for layer in LAYERS:
        assert any(m.startswith(f"miles_fsm.{layer}.") for m in modules), f"grimp saw no module of {layer}/"
    assert set(_engine_modules()) <= modules


def test_no_layer_imports_one_above_it(tmp_path):
    """import-linter keeps every contract: engine < states < drivers < apps, direct or indirect."""
    result = _lint(tmp_path, _tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken." in result.stdout


def test_an_upward_import_is_reported(tmp_path):
    """The check can fail: an engine module that imports the lifecycle breaks the engine contract."""
    site = _tree(tmp_path)
    planted = site / "miles_fsm" / "zz_planted.py"
    planted.write_text("from miles_fsm.states import DEFINITION\n")
    result = _lint(tmp_path, site, extra=("miles_fsm.zz_planted",))
    assert result.returncode != 0
    assert "miles_fsm.zz_planted -> miles_fsm.states" in result.stdout


@pytest.mark.parametrize(
    ("where", "text", "chain"),
    [
        ("trace", "from miles_fsm.replay.read import read_ranks\n", "miles_fsm.trace.zz_planted -> miles_fsm.replay"),
        ("replay", "import torch\n", "miles_fsm.replay.zz_planted -> torch"),
    ],
    ids=["trace-imports-replay", "replay-imports-torch"],
)
def test_the_trace_and_replay_contracts_can_fail(tmp_path, where, text, chain):
    """A writer module that imports the reader, or a replay module that imports torch, breaks its contract."""
    site = _tree(tmp_path)
    real = site / "miles_fsm" / where
    linked = real.resolve()
    real.unlink()  # a folder of links, so the planted module lands in the tree and not in the checkout
    real.mkdir()
    for entry in linked.iterdir():
        if entry.name != "__pycache__":
            (real / entry.name).symlink_to(entry)
    (real / "zz_planted.py").write_text(text)
    result = _lint(tmp_path, site, extra=(f"miles_fsm.{where}.zz_planted",))
    assert result.returncode != 0
    assert chain in result.stdout, result.stdout


def test_importing_every_replay_module_imports_no_torch():
    """The contract above exempts the functions that call torch's own Flight Recorder analyzer; this holds
    the rest of it at run time: no replay module, nor the CLI that runs replay, imports torch when loaded."""
    import miles_fsm.replay

    names = sorted(p.stem for p in Path(miles_fsm.replay.__file__).parent.glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module('miles_fsm.replay.' + name)\n"
        "import miles_fsm.apps.replay, miles_fsm.flight_recorder\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(names) > 20 and proc.stdout.strip() == "False", proc.stdout
