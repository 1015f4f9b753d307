"""``miles-fsm bench``: offload and wake against the hardware limits, in one JSON file.

The bench is measuring code, not library code: it lives in the repository's
``benchmarks/lifecycle/`` package, and this entry runs it from there. A source
checkout or an editable install has ``benchmarks/`` beside ``apps/``; an
installed wheel has not, and the command says how to run it instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["BENCHMARKS", "add_parser", "main"]

#: The repository's ``benchmarks/`` folder, when this file is a checkout's ``apps/bench.py``.
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
_PACKAGE = "lifecycle"
_NO_CHECKOUT = (
    "miles-fsm bench: the bench runs from a source checkout, and {} is not there (an installed wheel); "
    "run: git clone <the miles-fsm repository> miles-fsm && cd miles-fsm && pip install -e . "
    "&& python benchmarks/bench_lifecycle.py --out F.json\n"
)


def _bench() -> ModuleType | None:
    """The bench's ``cli`` module, imported from ``benchmarks/``; None without a checkout."""
    if not (BENCHMARKS / _PACKAGE / "cli.py").is_file():
        return None
    # First on the path, so that no installed distribution named `lifecycle` shadows the bench;
    # the rank processes the bench starts inherit the path and import it by the same name.
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(f"{_PACKAGE}.cli")


def _no_checkout(args: argparse.Namespace | None = None) -> int:
    sys.stderr.write(_NO_CHECKOUT.format(BENCHMARKS))
    return 2


def add_parser(sub: Any) -> None:
    about = {
        "help": "offload/wake and verification against the measured hardware limits; writes one JSON file",
        "description": (__doc__ or "").split("\n\n")[0],
    }
    bench = _bench()
    if bench is None:
        # The flags live with the bench: take every argument (--help too) as a word, and say where it runs.
        p = sub.add_parser("bench", prefix_chars="\0", add_help=False, **about)
        p.add_argument("ignored", nargs="*")
        p.set_defaults(run=_no_checkout)
        return
    p = sub.add_parser("bench", **about)
    bench.add_arguments(p)
    p.set_defaults(run=bench.run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m miles_fsm.apps.bench [flags]``: the same as ``miles-fsm bench [flags]``, usage errors included."""
    from miles_fsm.apps.cli import main as cli

    return cli(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
