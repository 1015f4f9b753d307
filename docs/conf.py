"""Sphinx configuration of the docs site: the guides (docs/*.md) and the API reference (docs/api/).

Build it as CI does: ``sphinx-build -W --keep-going -b html docs site`` (any
warning fails the build). The toolchain, and why: docs/architecture.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "miles-fsm"
author = "miles-fsm maintainers"
copyright = "2026, miles-fsm maintainers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "miles_api"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

# The reference's pages, one per public package (docs/api/*.md use them); tests/test_api_reference.py
# checks that every public package's every name is in the built site.
miles_api_packages = [
    "miles_fsm",
    "miles_fsm.errors",
    "miles_fsm.config",
    "miles_fsm.plan",
    "miles_fsm.states",
    "miles_fsm.launch",
    "miles_fsm.aio",
    "miles_fsm.guard",
    "miles_fsm.trace",
    "miles_fsm.replay",
    "miles_fsm.drivers",
    "miles_fsm.drivers.reference",
    "miles_fsm.drivers.megatron",
    "miles_fsm.drivers.sglang",
]

# Signatures as the source writes them; their types link to the page that documents each.
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_class_signature = "mixed"
autodoc_default_options = {"show-inheritance": True}
autodoc_inherit_docstrings = True
add_module_names = False
python_display_short_literal_types = True
# Every reference to a miles-fsm name must resolve (a broken one is a warning, so a failed build);
# the types of torch, the standard library and the other packages are shown, not linked.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!miles_fsm\b).*")]

# The guides are Markdown, read by MyST; their headings get anchors, which the guides link to.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = "miles-fsm"
html_static_path: list[str] = []


def setup(app: object) -> None:
    from pygments.lexers.special import TextLexer

    # docs/lifecycle.md's diagram is a ```mermaid fence, which GitHub draws; here it is shown as its source.
    app.add_lexer("mermaid", TextLexer)  # type: ignore[attr-defined]
