"""The ``miles-fsm demo`` subcommand: its flags, and the run they start."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any, NoReturn

from miles_fsm.apps.demo.config import INJECTION_KINDS, LAUNCHERS, TRAINERS, DemoConfig, Injection, fresh_trace_dir
from miles_fsm.apps.demo.report import print_result
from miles_fsm.apps.demo.run import run_demo
from miles_fsm.apps.demo.tracedir import EARLIER_RUNS
from miles_fsm.apps.errors import TraceDirUnusableError
from miles_fsm.states import Strategy

__all__ = ["STACKS", "add_parser"]

#: Where the demo runs: CPU ranks (the reference trainer, or megatron on gloo), or megatron and SGLang on a GPU.
STACKS = ("cpu", "megatron-sglang")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run the colocated loop on the reference trainer and engine (CPU, gloo)",
        description="Spawn N gloo ranks on CPU and run K verified RL steps; optionally inject faults.",
    )
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--steps", type=int, default=4, help="RL steps per rank (default 4)")
    p.add_argument("--mode", choices=[s.value for s in Strategy], default=Strategy.REMATERIALIZE.value)
    p.add_argument(
        "--trace-dir", type=Path, default=None,
        help=f"default: ./miles-fsm-traces/<timestamp>; rank traces of earlier runs in it are moved to "
        f"{EARLIER_RUNS}/<timestamp>/ inside it",
    )
    p.add_argument(
        "--inject", action="append", default=[], type=_injection, metavar="KIND:RANK:STEP",
        help=f"fault to inject, KIND in {'|'.join(INJECTION_KINDS)} (stall: a hang inside a collective, "
        "after its guard; undeclared: a collective the step's plan does not declare, caught by the plan audit); "
        "repeatable",
    )
    p.add_argument("--no-audit", dest="audit", action="store_false",
                   help="skip the plan audit (an undeclared collective then hangs the ranks; "
                   "replay --flight-recorder explains it)")
    p.add_argument("--guard-timeout", type=float, default=10.0, help="seconds a guard waits (default 10)")
    p.add_argument("--trainer", choices=TRAINERS, default="reference",
                   help="reference: the pure-torch trainer and engine (default); megatron: real megatron-core "
                   "DDP + distributed optimizer on CPU gloo (needs megatron-core 0.16; no engine, no --inject)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="local",
                   help="local: processes on this host (default); ray: Ray actors (needs ray). Under torchrun "
                   "(torchrun --nproc-per-node N -m miles_fsm demo) each worker runs one rank")
    p.add_argument("--stack", choices=STACKS, default="cpu",
                   help="cpu: the ranks above on CPU (default); megatron-sglang: one 1.1 B megatron GPT and a real "
                   "SGLang server sharing this host's GPU through --steps cycles of --mode, every cycle checked "
                   "against the engine (miles_fsm.apps.colocated; needs CUDA, sglang, megatron-core and "
                   "torch-memory-saver); its JSON goes to --trace-dir")
    p.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    p.add_argument("--dim", type=int, default=32, help="model width (default 32)")
    p.set_defaults(run=_run, _parser=p)


def _injection(text: str) -> Injection:
    try:
        return Injection.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    if args.stack == "megatron-sglang":
        _run_colocated(args)
    from rich.console import Console

    from miles_fsm.apps.demo.torchrun import torchrun_run_id, under_torchrun

    out = Console(highlight=False, soft_wrap=True)
    torchrun = under_torchrun()
    if torchrun:
        # Every worker must name the same folder: torchrun's run id does, a timestamp would not.
        default_dir = Path("miles-fsm-traces") / torchrun_run_id()
        args.ranks = int(os.environ["WORLD_SIZE"])
    else:
        default_dir = fresh_trace_dir(Path("miles-fsm-traces"))
    config = DemoConfig(
        ranks=args.ranks,
        steps=args.steps,
        mode=Strategy(args.mode),
        trace_dir=args.trace_dir if args.trace_dir is not None else default_dir,
        injections=tuple(args.inject),
        audit=args.audit,
        guard_timeout_s=args.guard_timeout,
        layers=args.layers,
        dim=args.dim,
        trainer=args.trainer,
        launcher=args.launcher,
    )
    problems = config.problems()
    if problems:
        _usage_error(args, "; ".join(problems))
    if torchrun:
        from miles_fsm.apps.demo.torchrun import torchrun_demo

        # The workers share the folder; the demo's own launcher is torchrun's agent here.
        config.trace_dir.mkdir(parents=True, exist_ok=True)
        return torchrun_demo(config, out)
    from miles_fsm.apps.demo.tracedir import prepare_trace_dir

    try:
        moved = prepare_trace_dir(config.trace_dir)
    except TraceDirUnusableError as exc:
        _usage_error(args, str(exc))
    out.print(
        f"miles-fsm demo: {config.ranks} ranks, {config.steps} steps, {config.mode.value}"
        + (f", injecting {', '.join(map(str, config.injections))}" if config.injections else "")
        + f"; traces in {config.trace_dir}"
    )
    if moved is not None:
        out.print(f"moved the rank traces of earlier runs to {moved}", markup=False)
    try:
        result = run_demo(config, out=out)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (LaunchInterrupted)
        signum = getattr(exc, "signum", signal.SIGINT)
        stopped = f"interrupted ({signal.Signals(signum).name}): every rank was stopped"
        out.print(f"{stopped}; {_left(config)}", markup=False)
        return 128 + int(signum)
    print_result(result, out)
    return result.exit_code


def _left(config: DemoConfig) -> str:
    """What an interrupted run left: the traces its ranks wrote (earlier runs' were moved aside), or none."""
    from miles_fsm.trace.writer import trace_path

    written = [r for r in range(config.ranks) if trace_path(config.trace_dir, r).exists()]
    if not written:
        return "no rank had written a trace yet (stopped while starting)"
    return f"partial traces of {len(written)} of {config.ranks} ranks in {config.trace_dir}"


# The CPU stack's options, by dest: the colocated loop has one GPU rank, the megatron
# trainer and a real engine, so none of them applies there.
_CPU_STACK_ONLY = {"ranks": "--ranks", "trainer": "--trainer", "launcher": "--launcher", "layers": "--layers",
                   "dim": "--dim", "inject": "--inject", "audit": "--no-audit", "guard_timeout": "--guard-timeout"}


def _run_colocated(args: argparse.Namespace) -> NoReturn:
    """The colocated loop on this host's GPU (``miles_fsm.apps.colocated``); refused, exit 2, where it cannot run."""
    from miles_fsm.apps.colocated.config import missing_requirements
    from miles_fsm.apps.demo.torchrun import under_torchrun

    parser: argparse.ArgumentParser = args._parser
    ignored = [flag for dest, flag in _CPU_STACK_ONLY.items() if getattr(args, dest) != parser.get_default(dest)]
    if ignored:
        _usage_error(args, f"{', '.join(ignored)} run(s) with --stack cpu only; --stack megatron-sglang takes "
                           "--steps, --mode and --trace-dir")  # fmt: skip
    if under_torchrun():
        _usage_error(args, "--stack megatron-sglang runs as one process on one GPU, not under torchrun")
    if args.steps < 1:
        _usage_error(args, f"--steps must be >= 1, got {args.steps}")
    missing = missing_requirements()
    if missing:
        _usage_error(args, f"--stack megatron-sglang runs on a CUDA host with sglang, megatron-core and "
                           f"torch-memory-saver installed; this host lacks {', '.join(missing)}")  # fmt: skip
    from miles_fsm.apps.colocated.run import main as colocated
    from miles_fsm.drivers.tms import exit_past_shutdown

    # The traces in --trace-dir, one folder per lifecycle, and the loop's JSON beside them: the loop
    # prints the replay command of each.
    trace_dir = args.trace_dir if args.trace_dir is not None else fresh_trace_dir(Path("miles-fsm-traces"))
    argv = ["--out", str(trace_dir / "colocated.json"), "--trace-dir", str(trace_dir)]
    code = colocated([*argv, "--strategy", args.mode, "--cycles", str(args.steps)])
    exit_past_shutdown(code)  # the JSON is written and the server stopped


def _usage_error(args: argparse.Namespace, message: str) -> NoReturn:
    """One line on stderr and exit 2, before any process starts (the parser's own one-line error)."""
    parser: argparse.ArgumentParser = args._parser
    parser.error(message)
