"""mkdocs hooks for the API reference: one page per public package, its ``__all__`` rendered.

A page holds the line ``<!-- api: PACKAGE -->``; it becomes the package's
docstring and one mkdocstrings block per name of the package's ``__all__``,
read at build time from the installed package, so a name added to
``__all__`` is documented without editing a page (and
``tests/test_api_reference.py`` checks that it was).

griffe finds packages on disk, not through the editable install's import
hook, so it would miss ``miles_fsm.states``, ``.drivers`` and ``.apps``
(pyproject's ``package-dir`` maps them in from the repo's top level). The
build therefore reads ``build/api-src/miles_fsm``: ``miles_fsm/`` with those
folders linked in where a wheel puts them.

A name exported by several packages (``miles_fsm.Lifecycle`` is
``miles_fsm.states.Lifecycle``) is documented on each of their pages, and
a cross-reference to its defining path (``miles_fsm.states.lifecycle.Lifecycle``)
goes to its home: the page of the most specific package that exports it
and holds its definition. The home shows a class's members; the other
pages its signature and docstring, and a link home (rendering each class
twice in full was half the build's time).
"""

from __future__ import annotations

import importlib
import re
import shutil
from pathlib import Path
from typing import Any

import griffe
from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]
SOURCE_TREE = ROOT / "build" / "api-src"
MAPPED = ("states", "drivers", "apps")  # pyproject [tool.setuptools.package-dir]
MARKER = re.compile(r"^<!-- api: (?P<package>[\w.]+) -->$", re.MULTILINE)

_HOMES: dict[tuple[str, str], str] = {}  # (package, exported name) -> defining path, for the name's home only
_ELSEWHERE: dict[tuple[str, str], str] = {}  # (package, exported name) -> its home's identifier, for the others


@event_priority(100)  # before mkdocstrings collects anything
def on_config(config: Any) -> Any:
    pkg = SOURCE_TREE / "miles_fsm"
    if SOURCE_TREE.exists():
        shutil.rmtree(SOURCE_TREE)
    pkg.mkdir(parents=True)
    for entry in (ROOT / "miles_fsm").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    for folder in MAPPED:
        (pkg / folder).symlink_to(ROOT / folder, target_is_directory=True)
    documented = [m.group("package") for page in Path(config["docs_dir"]).glob("*.md")
                  for m in MARKER.finditer(page.read_text())]
    _HOMES.clear()
    _ELSEWHERE.clear()
    for path, exports in exporters(documented).items():
        if len(exports) > 1:  # one page only: nothing to choose between
            home = max((e for e in exports if path.startswith(e[0] + ".")), key=lambda e: len(e[0]),
                       default=exports[0])
            _HOMES[home] = path
            _ELSEWHERE.update({e: ".".join(home) for e in exports if e != home})
    return config


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(lambda m: package_blocks(m.group("package")), markdown)


def exporters(packages: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Each defining path, and the (package, name) pairs that export it."""
    tree = griffe.load("miles_fsm", search_paths=[SOURCE_TREE], resolve_aliases=False, try_relative_path=False)
    out: dict[str, list[tuple[str, str]]] = {}
    for package in packages:
        module = tree if package == "miles_fsm" else tree[package.removeprefix("miles_fsm.")]
        for name in importlib.import_module(package).__all__:
            member = module.get_member(name) if name in module.all_members else None
            if member is None:
                continue  # the build fails on it anyway: mkdocstrings cannot collect it
            try:
                path = member.final_target.path if member.is_alias else member.path
            except griffe.AliasResolutionError:
                continue  # defined outside miles_fsm
            out.setdefault(path, []).append((package, name))
    return out


def package_blocks(package: str) -> str:
    """The package's docstring, then one heading and signature per name of its ``__all__``."""
    names = importlib.import_module(package).__all__
    blocks = [f"::: {package}\n    options:\n      members: false\n      show_root_heading: false\n"]
    for name in names:
        home = _ELSEWHERE.get((package, name))
        if home is None:
            blocks.append(f"::: {package}.{name}\n")
        else:
            blocks.append(f"::: {package}.{name}\n    options:\n      members: false\n\n"
                          f"Documented in full as [`{home}`][{home}].\n")
    return "\n".join(blocks)


def on_page_content(html: str, page: Any, config: Any, **_: Any) -> str:
    # mkdocstrings registers the defining path as a secondary URL of every
    # page that shows the name; the home's is made primary, so a signature
    # that names the type links to one place instead of warning.
    autorefs = config.plugins["autorefs"]
    for m in MARKER.finditer(page.file.content_string):
        package = m.group("package")
        for (home, name), defined in _HOMES.items():
            if home == package:
                autorefs.register_anchor(page, defined, f"{package}.{name}", primary=True)
    return html
