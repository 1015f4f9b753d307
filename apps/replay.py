"""``miles-fsm replay DIR``: its flags, and the run they start (``miles_fsm.replay.replay``).

Exit 0: healthy; 3: a problem was diagnosed; 2: bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable
from typing import Any, TextIO

import orjson

from miles_fsm.flight_recorder import FlightRecorderError
from miles_fsm.replay.checks import MAX_RANKS
from miles_fsm.replay.model import EpochRange, TraceDirError
from miles_fsm.replay.perfetto import OutputPathError, check_output, export_perfetto
from miles_fsm.replay.report import EXIT_BAD_INPUT, render
from miles_fsm.replay.several import Several, replay_folder

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="diagnose a hang, divergence or corruption from per-rank traces",
        description="Read DIR/rank-<r>.jsonl, re-drive the lifecycle per rank, and say where ranks diverged, "
        "who is stuck or crashed and in what, what failed verification, and who straggles. "
        "Exit 0: healthy; 3: a problem was diagnosed; 2: bad input.",
    )
    p.add_argument("dir", nargs="?", help="the trace directory (the --trace-dir of the run), or a folder of runs "
                   "(one sub-folder each: each is replayed, or the one --run names); leave it out to read "
                   "only the --flight-recorder dumps of a job without lifecycle traces")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument(
        "--flight-recorder", metavar="FRDIR",
        help="a folder of Flight Recorder dumps: torch's own (<prefix><rank>, e.g. nccl_trace_rank_0) or the "
        "lifecycle's fr-rank-<r>.json (default: those beside the traces). Says what torchfrtrace says of each "
        "process group, which collective each rank was in, and, with traces, in which step it was issued",
    )
    p.add_argument("--fr-prefix", metavar="PREFIX", help="the dumps' file name prefix (default: nccl_trace_rank_ "
                   "when present, else inferred as torchfrtrace does)")
    p.add_argument("--perfetto", metavar="OUT.json", help="also write a Chrome/Perfetto timeline to OUT.json")
    p.add_argument(
        "--rank",
        action="append",
        type=_parse_ranks,
        metavar="R",
        help="only these ranks: 3, 0,2 or 4-7 (repeatable)",
    )
    p.add_argument("--epoch", type=_parse_epochs, metavar="E", help="only these epochs: 2, 2:5 or 3:")
    p.add_argument("--run", dest="run_id", metavar="RUN_ID", help="read only this run's records, when DIR holds several runs; "
                   "in a folder of runs, the sub-folder of this name (or run id)")
    p.add_argument("--workers", type=int, default=None, help="processes to read with (default: by trace size)")
    p.add_argument(
        "--straggler-ratio", type=float, default=1.5, help="flag a rank this many times the median (default 1.5)"
    )
    p.set_defaults(run=_run, usage_error=p.error)


def _parse_ranks(text: str) -> list[int]:
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if not 0 <= first <= last < MAX_RANKS:
                raise argparse.ArgumentTypeError(f"--rank {part.strip()}: ranks are 0 to {MAX_RANKS - 1}, low to high")
            out.extend(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rank wants R, R,S or A-B, got {text!r}") from None
    return out


def _parse_epochs(text: str) -> EpochRange:
    try:
        return EpochRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    if args.dir is None:
        return _run_dumps_only(args)
    ranks = None if args.rank is None else [r for group in args.rank for r in group]
    try:
        diagnosis = replay_folder(  # DIR, or each run of a folder of runs (one sub-folder each)
            args.dir,
            ranks=ranks,
            epochs=args.epoch,
            workers=args.workers,
            straggler_ratio=args.straggler_ratio,
            perfetto=args.perfetto,
            run=args.run_id,
            flight_recorder=args.flight_recorder,
            fr_prefix=args.fr_prefix,
        )
    except (TraceDirError, OutputPathError, FlightRecorderError) as exc:
        sys.stderr.write(f"miles-fsm replay: {exc}\n")
        return EXIT_BAD_INPUT
    if isinstance(diagnosis, Several):
        return _print(args, diagnosis.to_json, diagnosis.render, diagnosis.exit_code)
    return _print(args, diagnosis.to_json, lambda out: render(diagnosis, out), diagnosis.exit_code)


def _print(args: argparse.Namespace, to_json: Callable[[], Any], report: Callable[[TextIO], None], code: int) -> int:
    """The ``--json`` object or the report on stdout, where the timeline went on stderr; ``code`` back."""
    if args.json:
        doc = to_json()
        try:
            text = orjson.dumps(doc, option=orjson.OPT_INDENT_2)
        except orjson.JSONEncodeError:  # a path that is not UTF-8 (a folder named in another encoding)
            text = orjson.dumps(_utf8(doc), option=orjson.OPT_INDENT_2)
        sys.stdout.buffer.write(text + b"\n")
        sys.stdout.flush()
    else:
        if isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout.reconfigure(errors="backslashreplace")  # a path that is not UTF-8 is shown as \xNN
        report(sys.stdout)
    if args.perfetto:
        sys.stderr.write(f"wrote the Perfetto timeline to {args.perfetto} (open it at https://ui.perfetto.dev)\n")
    return code


def _utf8(v: Any) -> Any:
    """``v`` with each string that holds bytes of a non-UTF-8 file name (surrogate escapes) spelled ``\\xNN``."""
    if v.__class__ is str:
        return v.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(v, dict):
        return {_utf8(k): _utf8(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_utf8(x) for x in v]
    return v


def _run_dumps_only(args: argparse.Namespace) -> int:
    """No trace directory: the Flight Recorder dumps alone (``miles_fsm.replay.fr_only``)."""
    trace_only = [flag for flag, value in (("--rank", args.rank), ("--epoch", args.epoch), ("--run", args.run_id))
                  if value is not None]  # fmt: skip
    if trace_only:
        args.usage_error(f"{', '.join(trace_only)} select(s) traces: give the trace directory dir")
    if args.flight_recorder is None:
        args.usage_error("the following arguments are required: dir (or --flight-recorder FRDIR alone)")
    from miles_fsm.replay.fr_only import collectives, replay_dumps

    try:
        if args.perfetto:
            check_output(args.perfetto, [], folders=[args.flight_recorder])
        result = replay_dumps(args.flight_recorder, prefix=args.fr_prefix)
        if args.perfetto:
            export_perfetto([], args.perfetto, collectives=collectives(result))
    except (OutputPathError, FlightRecorderError) as exc:
        sys.stderr.write(f"miles-fsm replay: {exc}\n")
        return EXIT_BAD_INPUT
    return _print(args, result.to_json, result.render, result.exit_code)
