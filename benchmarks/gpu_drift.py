"""Memory drift on one GPU (issue 28): megatron + torch_memory_saver, no false positive, a real leak caught.

One command on a CUDA host with megatron-core and torch-memory-saver:

    NCCL_GRAPH_REGISTER=0 python benchmarks/gpu_drift.py --out /tmp/drift_h200

writes ``drift_h200.json`` (and the traces) under ``--out``:

1. ``healthy``: per strategy, ``--cycles`` (10) cycles of the megatron driver
   with torch_memory_saver and a train step each, under ``DriftConfig(policy="raise")``
   with the default tolerance: any ``MemoryDriftError`` is a false positive
   (recorded, exit 1). The snapshot's cost per transition is set beside the
   transition's own time (the issue's bound: <= 1% of a data-moving one).
2. ``leak``: the backup strategy again; from cycle 3 on the run keeps one more
   pinned host buffer of ``--leak-mib`` alive per cycle, accounted under the
   host tag ``leaked_pinned`` (and, being page-locked, in the RSS). The live
   check (policy ``warn``) and replay of the traces must both name rank 0 and
   the tag (exit 1 otherwise).

Progress is printed per cycle; a failed check exits 1 with what failed.
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

LEAK_TAG = "leaked_pinned"


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


def _run(args: argparse.Namespace, state: dict[str, Any], saver: Any, strategy: str, trace_dir: Path,
         policy: str, leak_from: int | None) -> dict[str, Any]:  # fmt: skip
    import torch
    from lifecycle.gpu import gpu_train_step

    from miles_fsm.config import DriftConfig, GuardConfig, LifecycleConfig
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig
    from miles_fsm.drivers.megatron.driver import MegatronTrainer
    from miles_fsm.drivers.pinned import HostCopies, PinnedConfig
    from miles_fsm.states.drift import MemoryDriftWarning
    from miles_fsm.states.errors import MemoryDriftError
    from miles_fsm.states.lifecycle import Lifecycle

    leaked: list[torch.Tensor] = []

    class Leaky(MegatronTrainer):
        def host_bytes_by_tag(self) -> dict[str, int]:
            return {**super().host_bytes_by_tag(), LEAK_TAG: sum(t.numel() for t in leaked)}

    config = MegatronDriverConfig.from_megatron(state["chunks"], state["optimizer"], strategy=strategy, ci=False,
                                                verify_cycles=1, optimizer_offload="driver")  # fmt: skip
    driver = Leaky(chunks=state["chunks"], optimizer=state["optimizer"], config=config, memory=saver,
                   host=HostCopies(config=PinnedConfig()))  # fmt: skip
    lc = Lifecycle(trainer=driver, config=LifecycleConfig(guard=GuardConfig(timeout_s=600), verify=config.verify,
                                                          trace_dir=trace_dir, drift=DriftConfig(policy=policy)))  # fmt: skip
    rows = _timed_commits(lc)
    out: dict[str, Any] = {"strategy": strategy, "policy": policy, "false_positive": None, "warnings": []}
    with lc, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MemoryDriftWarning)
        lc.start()
        for c in range(1, args.cycles + 1):
            gpu_train_step(state, step=c)
            if leak_from is not None and c >= leak_from:
                buf = torch.empty(args.leak_mib << 20, dtype=torch.uint8, pin_memory=True)
                buf.fill_(1)  # touched: page-locked and resident
                leaked.append(buf)
            try:
                for name in ("offload", "pause", "rematerialize", "sync", "resume"):
                    lc.fire(name)
            except MemoryDriftError as exc:
                out["false_positive"] = {"cycle": c, **exc.fields()}
                print(f"  {strategy} cycle {c}: FALSE POSITIVE: {exc}", flush=True)
                break
            torch.cuda.synchronize()
            print(f"  {strategy} cycle {c}: ok ({len(leaked)} leaked buffers)", flush=True)
    out["warnings"] = [{"rank": w.message.rank, "kind": w.message.finding.kind, "tag": w.message.finding.tag,
                        "first_cycle": w.message.finding.first_cycle, "slope": w.message.finding.slope}
                       for w in caught if isinstance(w.message, MemoryDriftWarning)]  # fmt: skip
    out["cost"] = _cost(rows)
    leaked.clear()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="a folder: drift_h200.json and the traces go there")
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--leak-mib", type=int, default=256, help="pinned MiB leaked per cycle in the leak run")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args(argv)
    # The leak run leaks from cycle 3, after DriftConfig's 2 warm-up cycles: it needs cycles past that to be seen.
    if args.cycles < 5:
        p.error(f"--cycles must be >= 5 (the leak starts at cycle 3, after 2 warm-up cycles), got {args.cycles}")
    if args.leak_mib < 1:
        p.error(f"--leak-mib must be >= 1, got {args.leak_mib}")
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        sys.exit("gpu_drift: needs a CUDA device (torch.cuda.is_available() is False)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lifecycle.gpu import _build_gpt

    from miles_fsm.drivers.tms import TmsConfig, TmsMemorySaver
    from miles_fsm.replay.report import replay

    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    saver = TmsMemorySaver(config=TmsConfig(hook_mode="torch"))
    print("building the GPT ...", flush=True)
    state = _build_gpt(args, saver)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "params": state["params"], "healthy": {}}
    failed = []
    for strategy in ("rematerialize", "backup"):
        print(f"healthy run, {strategy}, {args.cycles} cycles, policy raise", flush=True)
        r = result["healthy"][strategy] = _run(args, state, saver, strategy, args.out / f"healthy-{strategy}",
                                               "raise", None)  # fmt: skip
        if r["false_positive"] is not None:
            failed.append(f"false positive under {strategy}: {r['false_positive']}")
    print(f"leak run, backup, {args.cycles} cycles, {args.leak_mib} MiB pinned per cycle from cycle 3", flush=True)
    leak = result["leak"] = _run(args, state, saver, "backup", args.out / "leak", "warn", 3)
    d = replay(str(args.out / "leak"))
    leak["replay"] = {"verdict": str(d.verdict), "exit_code": d.exit_code, "leaks": d.leaks}
    if not any(w["rank"] == 0 and w["tag"] == LEAK_TAG for w in leak["warnings"]):
        failed.append(f"the live check did not name rank 0 and {LEAK_TAG!r}: {leak['warnings']}")
    if not any(k["rank"] == 0 and k["tag"] == LEAK_TAG for k in d.leaks):
        failed.append(f"replay did not name rank 0 and {LEAK_TAG!r}: {d.leaks}")
    result["failed"] = failed
    path = args.out / "drift_h200.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    from miles_fsm.drivers.tms import exit_past_shutdown

    exit_past_shutdown(main())  # region tensors were made: the JSON is written by then
