"""``miles-fsm``: the command line.

Subcommands are imported lazily so ``miles-fsm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


#: Subcommand -> (module, one-line help). Each module defines
#: ``add_parser(subparsers)``, whose parser sets ``run=callable(args) -> exit code``.
#: Only the module of the subcommand being run is imported: a fast ``--help``,
#: and one subcommand's heavy (or broken) imports never take the others down.
_SUBCOMMANDS = {
    "bench": ("miles_fsm.apps.bench", "offload/wake and verification against the measured hardware limits, as one JSON file"),
    "demo": ("miles_fsm.apps.demo", "run the colocated RL loop on N local CPU ranks, with optional fault injection"),
    "diagram": ("miles_fsm.states.diagram", "print the lifecycle diagram (Markdown with Mermaid)"),
    "replay": ("miles_fsm.replay", "diagnose a run from its per-rank traces (divergence, stuck, crashed, stragglers)"),
}


def _build_parser(chosen: str | None) -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="miles-fsm", description="A guarded, traced memory lifecycle for colocated RL trainers."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in _SUBCOMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = _build_parser(chosen if chosen in _SUBCOMMANDS else None).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
