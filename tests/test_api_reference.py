"""The docs site (docs/conf.py: the guides and the API reference) builds with no warning and documents every
public name.

"Every public name" is each name of the ``__all__`` of every public package
(every package under ``miles_fsm`` but the CLI's ``apps``) and of the public
modules ``miles_fsm.errors``, ``miles_fsm.config`` and ``miles_fsm.plan``. A
name counts as documented when the built site's ``objects.inv`` (the
inventory Sphinx writes of every object it rendered) holds ``package.name``.

The site is built here with ``sphinx-build -W --keep-going`` (any warning
fails it). ``.ci/run`` has just built it from the same tree (into
``site/``), with the same flags, and says so in ``MILES_FSM_API_SITE``; the
test then reads that build instead of making a second one.
"""

from __future__ import annotations

import html
import importlib
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11 or later reads pyproject.toml")

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = ("miles_fsm.errors", "miles_fsm.config", "miles_fsm.plan")
#: The guides: every Markdown file of docs/ is a page of the site.
GUIDES = sorted(p.stem for p in (ROOT / "docs").glob("*.md") if p.stem != "index")

pytest.importorskip("sphinx", reason="the docs site needs the 'docs' extra: pip install -e '.[docs]'")

pytestmark = pytest.mark.slow


def public_packages() -> list[str]:
    # pyproject's list, which is what a wheel installs: the editable install maps states/ and
    # drivers/ in through an import hook, so walking ``miles_fsm.__path__`` would miss them.
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return [name for name in listed if not name.startswith("miles_fsm.apps")]


def build(out: Path) -> subprocess.CompletedProcess[str]:
    """The build CI runs: a fresh environment (-E), every warning an error, all of them reported."""
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def inventory(site: Path) -> set[str]:
    """The object names of a Sphinx ``objects.inv`` (version 2: four header lines, then zlib)."""
    raw = (site / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = raw.index(b"\n", header_end) + 1
    lines = zlib.decompress(raw[header_end:]).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line}


def text_of(page: Path) -> str:
    """A built page's main text, tags stripped."""
    main = page.read_text().split('id="furo-main-content"', 1)[-1]
    return html.unescape(re.sub(r"<[^>]+>", "", main))


@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]] | None:
    """This tree's site, built here the way CI builds it; None where ``.ci/run`` has just built it (with the
    same flags, so a warning failed it there)."""
    if os.environ.get("MILES_FSM_API_SITE"):
        return None
    out = tmp_path_factory.mktemp("docs") / "site"
    return out, build(out)


@pytest.fixture(scope="module")
def site(fresh_build: tuple[Path, subprocess.CompletedProcess[str]] | None) -> Path:
    if fresh_build is None:
        return ROOT / os.environ["MILES_FSM_API_SITE"]
    out, proc = fresh_build
    assert proc.returncode == 0, f"the docs build failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_the_docs_build_prints_no_warning(fresh_build: tuple[Path, subprocess.CompletedProcess[str]] | None) -> None:
    """The build CI runs exits 0 and prints nothing on stderr: no warning of Sphinx, of its theme (an
    end-of-life notice, as mkdocs-material 9.8 printed) or of a docstring."""
    if fresh_build is None:
        pytest.skip(".ci/run's own build ran with -W --keep-going just before: a warning failed it there")
    _, proc = fresh_build
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr


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
    assert module in documented, f"{module} has no page: add docs/api/<page>.rst holding '.. miles-api:: {module}'"
    names = importlib.import_module(module).__all__
    assert names, f"{module}.__all__ is empty"
    missing = sorted(name for name in names if f"{module}.{name}" not in documented)
    assert not missing, f"{module}.__all__ names missing from the API reference: {missing}"


def test_the_launchers_and_the_async_snapshot_show_their_signatures(site: Path) -> None:
    # what an embedder had to read the source for (issue 25)
    launch = (site / "api" / "launch.html").read_text()
    for name in ("run_ranks", "run_ranks_ray", "run_under_torchrun"):
        assert f'id="miles_fsm.launch.{name}"' in launch
    assert "timeout_s" in launch and "pg_timeout_s" in launch  # run_ranks's keyword parameters
    assert 'id="miles_fsm.launch.RankOutcome"' in launch
    aio = (site / "api" / "aio.html").read_text()
    assert 'id="miles_fsm.aio.AsyncSnapshot"' in aio


def test_the_driver_protocols_return_types_have_a_page(site: Path) -> None:
    """What a driver returns and is handed (``Collective``, ``TensorSet``, ``Step``, ``StepReport``) is
    documented, and the protocol's signatures link to it (issue 37: ``miles_fsm.plan`` had no page)."""
    documented = inventory(site)
    for name in ("miles_fsm.plan.Collective", "miles_fsm.plan.TensorSet", "miles_fsm.plan.TensorSpec",
                 "miles_fsm.states.Step", "miles_fsm.states.StepReport", "miles_fsm.states.RematerializingTrainer"):
        assert name in documented, name
    states = (site / "api" / "states.html").read_text()
    assert 'href="plan.html#miles_fsm.plan.Collective"' in states
    assert 'href="plan.html#miles_fsm.plan.TensorSet"' in states


def test_signatures_name_types_not_any(site: Path) -> None:
    """The async lifecycle's pages show the types (issue 37: ``AsyncLifecycle(lifecycle: Any)``, ``fire(trigger:
    Any)``), and an error's attributes show their type and what they hold, not ``role = role``."""
    states = text_of(site / "api" / "states.html")
    assert "AsyncLifecycle(lifecycle: Lifecycle)" in states
    aio = text_of(site / "api" / "aio.html")
    assert "fire(trigger: T | str)" in aio and "lifecycle: Any" not in aio
    errors = text_of(site / "api" / "errors.html")
    assert "rank: int" in errors and "The rank that raised the original exception." in errors
    assert not re.search(r"\b([a-z_]+) = \1\b", errors)
    top = text_of(site / "api" / "miles_fsm.html")
    assert "role: str" in top and not re.search(r"\brole = role\b", top)


@pytest.mark.parametrize("guide", GUIDES)
def test_every_guide_is_a_page_of_the_site(site: Path, guide: str) -> None:
    """The API reference links to the guides, and the guides to it: each docs/*.md is a page of the site."""
    assert (site / f"{guide}.html").is_file(), f"docs/{guide}.md is not in the site: add it to docs/index.md's toctree"


def test_the_reference_links_to_the_guides(site: Path) -> None:
    index = (site / "api" / "index.html").read_text()
    for guide in ("embedding", "async", "architecture"):
        assert f'href="../{guide}.html"' in index, guide


def _exported_errors() -> dict[str, type]:
    from miles_fsm.errors import MilesFsmError

    out: dict[str, type] = {}
    for module in [*public_packages(), *PUBLIC_MODULES]:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, type) and issubclass(obj, MilesFsmError):
                out[obj.__qualname__] = obj
    return out


#: Errors whose facts are not documented yet, and why (strict: the test says when one is).
_FACTS_LEFT: dict[str, str] = {}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.xfail(reason=_FACTS_LEFT[n], strict=True)] if n in _FACTS_LEFT else [])
    for n in sorted(_exported_errors())
])  # fmt: skip
def test_every_fact_of_an_exported_error_is_documented(site: Path, name: str) -> None:
    """An error's facts are its attributes (``fields()``): each has an entry, with its type and what it holds."""
    documented = inventory(site)
    for fact in _exported_errors()[name]._fields:
        assert any(entry.endswith(f".{name}.{fact}") for entry in documented), f"{name}.{fact} is not documented"
