"""Memory drift on one GPU (issues 28, 37): megatron + torch_memory_saver, no false positive, user leaks caught.

One command on a CUDA host with megatron-core and torch-memory-saver (``pytest -m gpu`` runs it through
``tests/test_drift_gpu.py``):

    NCCL_GRAPH_REGISTER=0 python benchmarks/gpu_drift.py --out /tmp/drift_gpu

writes ``drift_gpu.json`` (and the traces) under ``--out``:

1. ``healthy``: per strategy, ``--cycles`` (20) cycles of the megatron driver
   with torch_memory_saver and a train step each, under ``DriftConfig(policy="raise")``,
   the defaults otherwise: any finding is a false positive (exit 1). The
   snapshot's cost per transition is set beside the transition's own time.
2. ``leaks``: the backup strategy, ``--leak-cycles`` (12) cycles under the
   default ``DriftConfig()`` (policy ``warn``); from cycle 3 on, after each train
   step, the run keeps one more buffer in a plain list, as a user's code
   would: no tag, no driver accounting.
   - ``device``: a CUDA tensor of ``--device-leak-mib`` (128), written;
   - ``pinned``: a ``pin_memory=True`` host tensor of ``--pinned-leak-mib`` (256), written.

   Each must be named within 4 cycles of its start, once, by the innermost
   figure that grew (``drift_checks.HELD_IN``: torch's allocated bytes, which
   torch's reserved bytes and the device in use hold; torch's pinned bytes,
   which the RSS holds) and no other, its slope within 15% of the truth, live
   and in replay (which exits 3).

Progress is printed per cycle; a failed check exits 1 with what failed (``failed`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from drift_checks import check_healthy, check_leak

MiB = 1 << 20
LEAK_FROM = 3


def _timed_commits(lc: Any) -> list[tuple[str, float, float]]:
    """Wrap the machine's on_commit (the snapshot) with a timer; returns the rows it fills."""
    machine = lc._machine
    observe = machine._on_commit
    rows: list[tuple[str, float, float]] = []

    def timed(result: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return observe(result)
        finally:
            rows.append((result.trigger.value, result.duration_s, time.perf_counter() - t0))

    machine._on_commit = timed
    return rows


def _cost(rows: list[tuple[str, float, float]]) -> dict[str, Any]:
    out = {}
    for trig in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == trig]
        tx, snap = statistics.median(r[1] for r in mine), statistics.median(r[2] for r in mine)
        out[trig] = {"n": len(mine), "transition_median_s": tx, "snapshot_median_s": snap,
                     "ratio": snap / tx if tx else None}  # fmt: skip
    return out


def named_in(caught: list[Any], cycle: int) -> list[dict[str, Any]]:
    """The drift warnings among ``caught`` (other libraries' warnings are there too), as named at ``cycle``."""
    from miles_fsm.states.drift import MemoryDriftWarning

    return [{"rank": m.rank, "kind": m.finding.kind, "tag": m.finding.tag, "state": m.finding.state,
             "named_at": cycle, "first_cycle": m.finding.first_cycle, "slope": m.finding.slope,
             "grown": m.finding.grown, "inside": m.finding.inside, "grew_with": dict(m.finding.grew_with)}
            for m in (w.message for w in caught) if isinstance(m, MemoryDriftWarning)]  # fmt: skip


def _leak_maker(kind: str | None, nbytes: int) -> Any:
    """What a user's leak keeps per cycle: a written CUDA tensor, or a written pinned host tensor."""
    import torch

    if kind == "device":
        return lambda: torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    if kind == "pinned":
        return lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    return None


def _run(state: dict[str, Any], saver: Any, strategy: str, trace_dir: Path, *, cycles: int, policy: str,
         leak: str | None = None, leak_bytes: int = 0) -> dict[str, Any]:  # fmt: skip
    import torch
    from lifecycle.gpu import gpu_train_step

    from miles_fsm.config import DriftConfig, GuardConfig, LifecycleConfig
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig
    from miles_fsm.drivers.megatron.driver import MegatronTrainer
    from miles_fsm.drivers.pinned import HostCopies, PinnedConfig
    from miles_fsm.states.drift import MemoryDriftWarning
    from miles_fsm.states.errors import MemoryDriftError
    from miles_fsm.states.lifecycle import Lifecycle

    kept: list[torch.Tensor] = []  # the user's leak: a plain list nobody reports
    make = _leak_maker(leak, leak_bytes)
    config = MegatronDriverConfig.from_megatron(state["chunks"], state["optimizer"], strategy=strategy, ci=False,
                                                verify_cycles=1, optimizer_offload="driver")  # fmt: skip
    driver = MegatronTrainer(chunks=state["chunks"], optimizer=state["optimizer"], config=config, memory=saver,
                             host=HostCopies(config=PinnedConfig()))  # fmt: skip
    lc = Lifecycle(trainer=driver, config=LifecycleConfig(guard=GuardConfig(timeout_s=600), verify=config.verify,
                                                          trace_dir=trace_dir, drift=DriftConfig(policy=policy)))  # fmt: skip
    rows = _timed_commits(lc)
    out: dict[str, Any] = {"strategy": strategy, "policy": policy, "cycles": cycles, "cycles_done": 0,
                           "leak": leak, "leak_bytes": leak_bytes, "false_positive": None, "warnings": []}  # fmt: skip
    seen = 0  # of the warnings caught (other libraries' warnings among them)
    with lc, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MemoryDriftWarning)
        lc.start()
        for c in range(1, cycles + 1):
            gpu_train_step(state, step=c)
            if make is not None and c >= LEAK_FROM:
                kept.append(make())
            try:
                for name in ("offload", "pause", "rematerialize", "sync", "resume"):
                    lc.fire(name)
            except MemoryDriftError as exc:
                out["false_positive"] = {"cycle": c, **exc.fields()}
                print(f"  {strategy} cycle {c}: FALSE POSITIVE: {exc}", flush=True)
                break
            torch.cuda.synchronize()
            out["cycles_done"] = c
            new = named_in(caught[seen:], c)
            seen = len(caught)
            out["warnings"] += new
            named = ", ".join(f"{w['kind']} {w['tag']} {w['slope'] / MiB:.1f} MiB/cycle" for w in new)
            print(f"  {strategy} cycle {c}: ok ({len(kept)} kept){'; named ' + named if named else ''}", flush=True)
    out["cost"] = _cost(rows)
    kept.clear()
    torch.cuda.empty_cache()
    return out


def replay_run(trace_dir: Path) -> dict[str, Any]:
    """Replay's judgement of a run's traces, and rank 0's snapshots at TRAINING (the figures, cycle by cycle)."""
    from miles_fsm.replay.report import replay

    d = replay(str(trace_dir))
    snaps = []
    for line in (trace_dir / "rank-0.jsonl").read_text().splitlines():
        rec = json.loads(line) if '"memory_snapshot"' in line else None
        if rec is not None and rec.get("state") == "TRAINING":
            snaps.append({k: rec.get(k) for k in ("epoch", "device", "host", "rss")})
    return {"verdict": str(d.verdict), "exit_code": d.exit_code, "leaks": d.leaks, "notes": d.notes,
            "training_snapshots": snaps}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="a folder: drift_gpu.json and the traces go there")
    p.add_argument("--cycles", type=int, default=20, help="healthy cycles per strategy")
    p.add_argument("--leak-cycles", type=int, default=12, help="cycles of each leak run (the leak from cycle 3)")
    p.add_argument("--device-leak-mib", type=int, default=128, help="CUDA MiB kept per cycle in the device leak run")
    p.add_argument("--pinned-leak-mib", type=int, default=256, help="pinned MiB kept per cycle in the pinned run")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args(argv)
    # A leak from cycle 3 is named by cycle 6 at the latest (2 warm-up cycles, the baseline, 3 rises).
    if args.leak_cycles < LEAK_FROM + 3:
        p.error(f"--leak-cycles must be >= {LEAK_FROM + 3} (the leak starts at cycle {LEAK_FROM}), got {args.leak_cycles}")
    if args.cycles < 1 or args.device_leak_mib < 1 or args.pinned_leak_mib < 1:
        p.error("--cycles, --device-leak-mib and --pinned-leak-mib must be >= 1")
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        sys.exit("gpu_drift: needs a CUDA device (torch.cuda.is_available() is False)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lifecycle.gpu import _build_gpt

    from miles_fsm.drivers.tms import TmsConfig, TmsMemorySaver

    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    saver = TmsMemorySaver(config=TmsConfig(hook_mode="torch"))
    print("building the GPT ...", flush=True)
    state = _build_gpt(args, saver)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "params": state["params"], "leak_from": LEAK_FROM, "healthy": {}, "leaks": {}}  # fmt: skip
    failed: list[str] = []
    for strategy in ("rematerialize", "backup"):
        print(f"healthy run, {strategy}, {args.cycles} cycles, policy raise", flush=True)
        r = result["healthy"][strategy] = _run(state, saver, strategy, args.out / f"healthy-{strategy}",
                                               cycles=args.cycles, policy="raise")  # fmt: skip
        r["replay"] = replay_run(args.out / f"healthy-{strategy}")
        failed += check_healthy(r, strategy=strategy)
    for kind, mib in (("device", args.device_leak_mib), ("pinned", args.pinned_leak_mib)):
        print(f"{kind} leak run, backup, {args.leak_cycles} cycles, {mib} MiB per cycle from cycle {LEAK_FROM}, "
              "untagged", flush=True)  # fmt: skip
        r = result["leaks"][kind] = _run(state, saver, "backup", args.out / f"leak-{kind}", cycles=args.leak_cycles,
                                         policy="warn", leak=kind, leak_bytes=mib * MiB)  # fmt: skip
        r["replay"] = replay_run(args.out / f"leak-{kind}")
        failed += check_leak(r, kind=kind, per_cycle=mib * MiB, start=LEAK_FROM)
    result["failed"] = failed
    path = args.out / "drift_gpu.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    from miles_fsm.drivers.tms import exit_past_shutdown

    exit_past_shutdown(main())  # region tensors were made: the JSON is written by then
