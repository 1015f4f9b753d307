"""The distribution: a wheel built from the repo installs and imports all three packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_wheel_installs_and_imports_all_three_packages(tmp_path):
    """The wheel maps states/, drivers/ and apps/ into miles_fsm, ships py.typed and the console script,
    and imports from the installed copy, not from the checkout."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("miles_fsm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "miles_fsm/py.typed" in names
    assert "miles_fsm/states/definition.py" in names
    assert "miles_fsm/states/protocols.py" in names
    assert "miles_fsm/errors/__init__.py" in names and "miles_fsm/errors/guard.py" in names
    assert "miles_fsm/drivers/reference/trainer.py" in names
    assert "miles_fsm/apps/cli.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import miles_fsm, miles_fsm.states, miles_fsm.drivers, miles_fsm.apps.cli;"
        "print(miles_fsm.__file__); print(miles_fsm.states.__file__); print(miles_fsm.drivers.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(out) == 3 and all(p.startswith(str(site)) for p in out), out


def test_public_api_is_declared():
    """Each public package declares __all__, and every name in it exists."""
    import miles_fsm
    import miles_fsm.drivers
    import miles_fsm.states

    for mod in (miles_fsm, miles_fsm.states, miles_fsm.drivers):
        assert mod.__all__, mod.__name__
        for name in mod.__all__:
            assert hasattr(mod, name), f"{mod.__name__}.{name}"
