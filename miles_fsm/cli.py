"""``miles-fsm``: the command line.

Subcommands are imported lazily so ``miles-fsm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


#: Modules of ``miles_fsm`` that each define ``add_parser(subparsers)``; the
#: parser they add sets ``run=callable(args) -> exit code``.
_SUBCOMMANDS = ("demo", "diagram", "replay")


def _build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="miles-fsm", description="A guarded, traced memory lifecycle for colocated RL trainers."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(f"miles_fsm.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
