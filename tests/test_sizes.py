"""Small pieces: no library function over 80 lines, and no module over 400 (issue 25).

A newcomer reads a function whole; past a screen or two it holds several
ideas. The few exceptions are named here, each with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("miles_fsm", "states", "drivers", "apps")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400

#: Functions allowed over the limit, and why (none).
LONG_FUNCTIONS: dict[str, int] = {}
#: Modules allowed over the limit, and why (none).
LONG_MODULES: dict[str, int] = {}


def _library_files(root: Path) -> list[Path]:
    return sorted(p for d in LIBRARY for p in (root / d).rglob("*.py") if ".venv" not in p.parts)


def oversized(root: Path) -> list[str]:
    """Every function and module of the library under ``root`` over its limit (or its named allowance)."""
    out = []
    for path in _library_files(root):
        name = path.relative_to(root).as_posix()
        src = path.read_text()
        lines = len(src.splitlines())
        if lines > LONG_MODULES.get(name, MAX_MODULE_LINES):
            out.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > LONG_FUNCTIONS.get(f"{name}::{node.name}", MAX_FUNCTION_LINES):
                    out.append(f"{name}::{node.name}: {n} lines")
    return out


def test_library_pieces_are_small() -> None:
    assert oversized(ROOT) == []
