"""``miles-fsm``: the command line.

Subcommands are imported lazily so ``miles-fsm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["main"]

DISTRIBUTION = "miles-fsm"


#: Subcommand -> (module, one-line help). Each module defines
#: ``add_parser(subparsers)``, whose parser sets ``run=callable(args) -> exit code``.
#: Only the module of the subcommand being run is imported: a fast ``--help``,
#: and one subcommand's heavy (or broken) imports never take the others down.
_SUBCOMMANDS = {
    "bench": ("miles_fsm.apps.bench", "offload/wake and verification against the measured hardware limits, as one JSON file"),
    "demo": ("miles_fsm.apps.demo", "run the colocated RL loop on N local CPU ranks, with optional fault injection"),
    "diagram": ("miles_fsm.apps.diagram", "print the lifecycle diagram (Markdown with Mermaid)"),
    "replay": ("miles_fsm.apps.replay", "diagnose a run from its per-rank traces (divergence, stuck, crashed, stragglers)"),
}


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line on stderr, ``PROG: error: WHY; see PROG --help``, and exit 2.

    argparse's own error prints the usage first, several lines a script or a person must read past
    to find why. Subcommand parsers are made by ``add_subparsers``, which builds them with this
    class too, so every subcommand's flags fail the same way; ``--help`` is untouched.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; see {self.prog} --help\n")


class _Version(argparse.Action):
    """``--version``: the installed distribution's version, read only when asked (a fast ``--help``)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 help: str = "print the installed version of miles-fsm and exit") -> None:  # fmt: skip
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version(DISTRIBUTION)
        except PackageNotFoundError:
            parser.exit(1, f"{parser.prog}: no installed distribution {DISTRIBUTION} (running from a source tree "
                        "that was not installed; run pip install -e . in it)\n")  # fmt: skip
        sys.stdout.write(f"{parser.prog} {installed}\n")
        parser.exit(0)


def _build_parser(chosen: str | None) -> tuple[argparse.ArgumentParser, Any]:
    """The parser, and its subparsers action (whose ``choices`` hold each subcommand's parser)."""
    import importlib

    parser = OneLineParser(prog="miles-fsm", description="A guarded, traced memory lifecycle for colocated RL trainers.")
    parser.add_argument("--version", action=_Version)
    # Not required=True: main() says what is wrong when no subcommand came, an unknown flag first.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _SUBCOMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser, sub


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser, sub = _build_parser(chosen if chosen in _SUBCOMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse reports a subcommand's unknown flags from the top parser, as "miles-fsm: ...":
        # name the subcommand they were given to, whose --help lists the flags it has.
        before = argv[: argv.index(args.command)] if args.command else argv
        given_to = parser if unknown[0] in before else sub.choices[args.command]
        given_to.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.error("the following arguments are required: COMMAND")
    return int(args.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
