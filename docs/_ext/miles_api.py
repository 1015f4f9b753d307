"""Sphinx extension for the API reference: one page per public package, its ``__all__`` rendered.

A page (``docs/api/aio.rst``) holds the directive ``.. miles-api::
miles_fsm.aio``. It becomes the package's
docstring and one autodoc entry per name of the package's ``__all__``,
read at build time from the installed package, so a name added to
``__all__`` is documented without editing a page (and
``tests/test_api_reference.py`` checks that it was).

A name exported by several packages (``miles_fsm.Lifecycle`` is
``miles_fsm.states.Lifecycle``) is documented on each of their pages under
that package's name. Its *home* is the most specific package that exports
it and holds its definition: there a class shows its members; the other
pages show its signature and docstring and link home (rendering every class
in full on every page would double the build).

A signature names a type by where it is defined
(``miles_fsm.states.lifecycle.Lifecycle``): autodoc registers that path as
the home entry's canonical name, so the reference lands home. Only the home
registers it (two would be a duplicate), and the other pages' entries are
aliases, so a bare ``Lifecycle`` in a signature resolves to the home, not
to several candidates.

A type that a public signature names but no package exports (what
``Lifecycle.start`` returns: ``miles_fsm.machine.TransitionResult``) is
documented under its own path on the page of the package that hands it
out: the directive's ``:also:`` option lists them.

A type variable (``Definition``'s ``S``) has no entry: a reference to one
is shown as text.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.domains.python import PythonDomain
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

#: Every documented package, in the order of the reference's pages. ``conf.py`` passes the list.
PACKAGES_CONFIG = "miles_api_packages"


def _defined_at(obj: object) -> str | None:
    """``module.qualname`` of a class or function defined in miles_fsm, else None."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str) and module.startswith("miles_fsm")):
        return None
    return f"{module}.{qualname}"


def homes(packages: Iterable[str]) -> dict[str, str]:
    """Each defining path (``miles_fsm.states.lifecycle.Lifecycle``) of a class or function some package
    exports -> its home's documented name (``miles_fsm.states.Lifecycle``)."""
    exporters: dict[str, list[str]] = {}
    for package in packages:
        module = importlib.import_module(package)
        for name in module.__all__:
            path = _defined_at(getattr(module, name))
            if path is not None:
                exporters.setdefault(path, []).append(f"{package}.{name}")
    out = {}
    for path, documented in exporters.items():
        # The most specific exporting package that the definition lives under; else the first page.
        inside = [d for d in documented if path.startswith(d.rsplit(".", 1)[0] + ".")]
        out[path] = max(inside, key=len) if inside else documented[0]
    return out


def _directive(obj: object) -> str:
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "autofunction"
    return "autodata"


def _entries(package: str, also: list[str]) -> list[tuple[str, object]]:
    """(documented name, object) for each name of ``package.__all__``, then each path of ``also``."""
    module = importlib.import_module(package)
    out = [(f"{package}.{name}", getattr(module, name)) for name in module.__all__]
    for path in also:
        owner, name = path.rsplit(".", 1)
        out.append((path, getattr(importlib.import_module(owner), name)))
    return out


def package_rst(package: str, home_of: dict[str, str], also: list[str]) -> list[str]:
    """The package's docstring, then one autodoc entry per name of its ``__all__`` (and of ``also``)."""
    lines = [f".. automodule:: {package}", "   :no-members:", ""]
    for documented, obj in _entries(package, also):
        directive = _directive(obj)
        path = _defined_at(obj)
        home = home_of.get(path, documented) if path else documented
        lines.append(f".. {directive}:: {documented}")
        if directive == "autodata":
            lines.append("   :no-value:")
        if inspect.isclass(obj) and home == documented:
            lines += ["   :members:", "   :member-order: bysource"]
        lines.append("")
        if home != documented:
            role = "exc" if directive == "autoexception" else "class" if directive == "autoclass" else "obj"
            lines += [f"   Documented in full as :py:{role}:`{home}`.", ""]
    return lines


class MilesApi(SphinxDirective):
    """``miles-api PACKAGE``: the package's reference (see the module's docstring)."""

    required_arguments = 1
    has_content = False
    option_spec = {"also": lambda text: (text or "").split()}

    def run(self) -> list[nodes.Node]:
        package = self.arguments[0]
        source = StringList()
        also = self.options.get("also", [])
        for line in package_rst(package, self.env.app.miles_api_homes, also):  # type: ignore[attr-defined]
            source.append(line, f"<miles-api {package}>")
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, source, node)
        return node.children


def _setup_homes(app: Sphinx) -> None:
    home_of = homes(app.config[PACKAGES_CONFIG])
    app.miles_api_homes = home_of  # type: ignore[attr-defined]
    app.miles_api_elsewhere = _documented(app.config[PACKAGES_CONFIG]) - set(home_of.values())  # type: ignore[attr-defined]


def _documented(packages: Iterable[str]) -> set[str]:
    """Every ``package.name`` whose object is defined elsewhere in miles_fsm (it may have a home elsewhere)."""
    out = set()
    for package in packages:
        module = importlib.import_module(package)
        for name in module.__all__:
            path = _defined_at(getattr(module, name))
            if path is not None and path != f"{package}.{name}":
                out.add(f"{package}.{name}")
    return out


class _HomesPythonDomain(PythonDomain):
    """The Python domain, with one canonical entry per type: its home's (see the module's docstring)."""

    def note_object(self, name: str, objtype: str, node_id: str, aliased: bool = False, location: Any = None) -> None:
        home_of: dict[str, str] = self.env.app.miles_api_homes  # type: ignore[attr-defined]
        if aliased and name in home_of and node_id != home_of[name]:
            return  # a page other than the home: the home's entry holds the canonical path
        if not aliased and name not in home_of and name in self.env.app.miles_api_elsewhere:  # type: ignore[attr-defined]
            aliased = True  # documented at home too: a bare name resolves to the home
        super().note_object(name, objtype, node_id, aliased, location)


def _data_doc(app: Sphinx, what: str, name: str, obj: object, options: Any, lines: list[str]) -> None:
    """A constant re-exported by a package (``miles_fsm.states.CYCLE``) gets the doc comment it has where
    it is defined, never its type's docstring (a tuple's "Built-in immutable sequence")."""
    if what != "data":
        return
    short = name.rsplit(".", 1)[1]
    for module_name in sorted(m for m in sys.modules if m.startswith("miles_fsm")):
        if getattr(sys.modules[module_name], short, None) is not obj:
            continue
        try:
            doc = ModuleAnalyzer.for_module(module_name).find_attr_docs().get(("", short))
        except PycodeError:
            continue
        if doc:
            lines[:] = list(doc)
            return
    if type(obj).__doc__ and lines and lines[0].strip() == inspect.cleandoc(type(obj).__doc__).splitlines()[0]:
        lines[:] = []


def _protocol_signature(app: Sphinx, what: str, name: str, obj: object, options: Any, signature: str | None,
                        return_annotation: str | None) -> tuple[str, str | None] | None:
    """A protocol is not built by its user: no ``(*args, **kwargs)`` after its name."""
    if inspect.isclass(obj) and getattr(obj, "_is_protocol", False):
        return "", return_annotation
    return None


def _no_object_base(app: Sphinx, name: str, obj: object, options: Any, bases: list[type]) -> None:
    """``Bases: object`` says nothing: a class with no other base shows none."""
    bases[:] = [b for b in bases if b is not object]


def _type_variable(app: Sphinx, env: Any, node: Any, contnode: nodes.Element) -> nodes.Element | None:
    """A type variable (``miles_fsm.definition.S``) is shown as its name: it has no entry to link to."""
    owner, _, name = node.get("reftarget", "").rpartition(".")
    if node.get("refdomain") != "py" or not owner.startswith("miles_fsm"):
        return None
    try:
        obj = getattr(importlib.import_module(owner), name, None)
    except ImportError:
        return None
    return contnode if isinstance(obj, TypeVar) else None


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value(PACKAGES_CONFIG, [], "env")
    app.add_directive("miles-api", MilesApi)
    app.add_domain(_HomesPythonDomain, override=True)
    app.connect("builder-inited", _setup_homes)
    app.connect("missing-reference", _type_variable)
    app.connect("autodoc-process-docstring", _data_doc)
    app.connect("autodoc-process-signature", _protocol_signature)
    app.connect("autodoc-process-bases", _no_object_base)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
