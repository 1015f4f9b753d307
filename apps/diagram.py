"""``miles-fsm diagram``: the lifecycle diagram, generated from the machine definition."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from miles_fsm.states.diagram import lifecycle_markdown, mermaid

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("diagram", help="print the lifecycle diagram (Markdown with Mermaid)")
    p.add_argument("--mermaid", action="store_true", help="print only the Mermaid source")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    sys.stdout.write((mermaid() + "\n") if args.mermaid else lifecycle_markdown())
    return 0
