"""How a demo run ended: the result, whom to blame, and the summary the CLI prints.

Blame follows the strength of the evidence, so the same fault names the
same rank on every run however the ranks' views raced:

1. ranks that died on their own (killed by a signal or exiting non-zero
   without reporting, and not stopped by the launcher): a dead process is
   a fact, and every error its peers saw afterwards is its consequence;
2. the ranks the errors name (their ``culprits`` / ``missing`` fields), by
   how many errors name them; ties name every tied rank;
3. the replay diagnosis of the run's traces (a hang inside a collective
   leaves only a gloo timeout on the survivors: the trace says who stopped);
   when the traces cannot decide, nobody (``culprit: unknown``);
4. the ranks that reported an error.
"""

from __future__ import annotations

import signal
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles_fsm.apps.demo.config import FAILING_KINDS, DemoConfig, Injection
from miles_fsm.launch.local import RankOutcome
from miles_fsm.replay.diagnose import Diagnosis
from miles_fsm.replay.evidence import last_own_record, stopped_from_outside
from miles_fsm.replay.model import RankTrace

__all__ = ["DemoResult", "blame", "print_result"]

_ROWS = ("start", "offload", "pause", "generate", "rematerialize", "sync", "resume", "train")


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoResult:
    """How a demo run ended, for the CLI, tests and the benchmark."""

    config: DemoConfig
    run_id: str
    outcomes: tuple[RankOutcome, ...]
    wall_s: float
    verified: dict[int, int]
    culprits: tuple[int, ...]
    diagnosis: str

    @property
    def finished(self) -> bool:
        """Every rank ran every step, verified."""
        return all(o.ok for o in self.outcomes) and all(
            self.verified.get(r, 0) == self.config.steps for r in range(self.config.ranks)
        )

    @property
    def drift_unjudged(self) -> tuple[str | None, bool]:
        """(why this run was too short to judge memory drift, or None; whether that hid an injected leak).

        A leak the live check named anyway (past the threshold early) was judged.
        """
        from miles_fsm.apps.demo.faults import drift_unjudged

        note, leak = drift_unjudged(self.config.steps, self.config.injections)
        return (None, False) if leak and self.drift() else (note, leak)

    @property
    def unnoticed(self) -> tuple[Injection, ...]:
        """The injected faults that should have failed the run, when it finished anyway (none otherwise)."""
        return tuple(i for i in self.config.injections if i.kind in FAILING_KINDS) if self.finished else ()

    @property
    def ok(self) -> bool:
        return self.finished and not self.unnoticed

    @property
    def exit_code(self) -> int:
        """1 when the run failed, or an injected leak went unjudged (the run was too short to show it)."""
        return 0 if self.ok and not self.drift_unjudged[1] else 1

    def rows(self) -> list[dict[str, Any]]:
        return [row for o in self.outcomes if o.ok for row in o.result["rows"]]

    def summary(self) -> list[dict[str, Any]]:
        """One row per phase: count, median time, median bytes moved, peak device bytes, max host bytes."""
        out = []
        for name in _ROWS:
            rows = [r for r in self.rows() if r["name"] == name]
            if not rows:
                continue
            moved = [r["bytes_moved"] for r in rows if r["bytes_moved"] is not None]
            out.append(
                {
                    "name": name,
                    "count": len(rows),
                    "median_s": statistics.median(r["duration_s"] for r in rows),
                    "bytes_moved": int(statistics.median(moved)) if moved else None,
                    "peak_bytes": max(r["peak_bytes"] for r in rows),
                    "host_bytes": max(r["host_bytes"] for r in rows),
                }
            )
        return out

    def drift(self) -> list[dict[str, Any]]:
        """The memory drift each rank's live check found (``MemoryDriftWarning``s), with the rank."""
        return [{"rank": o.rank, **f} for o in self.outcomes if o.ok for f in o.result.get("drift", ())]

    def held(self) -> dict[str, int]:
        """Host bytes held while PAUSED, on rank 0 (every rank holds the same)."""
        return next((o.result["held"] for o in self.outcomes if o.ok), {})


# ---------------------------------------------------------------- blame


def blame(
    outcomes: Sequence[RankOutcome], traces: Mapping[int, RankTrace], replay: Diagnosis | None
) -> tuple[tuple[int, ...], str]:
    """Who is to blame and a few lines saying why: the ranks' errors and exit codes, then the traces."""
    if all(o.ok for o in outcomes):
        return (), ""
    named: Counter[int] = Counter()
    died: list[int] = []
    lines = []
    for o in outcomes:
        if o.error is not None:
            first = o.error.message.splitlines()[0] if o.error.message else ""
            lines.append(f"rank {o.rank}: {o.error.type}: {_clip(first)}")
            for r in o.error.attrs.get("culprits") or o.error.attrs.get("missing") or ():
                named[int(r)] += 1
        elif o.ok:
            lines.append(f"rank {o.rank}: finished")
        else:
            if o.killed:
                how = "stopped by the demo after another rank failed: it was blocked or hung"
            else:
                how = f"died without reporting ({_exit_text(o.exitcode)})"
                died.append(o.rank)
            lines.append(f"rank {o.rank}: {how}; its trace ends with {trace_end(traces.get(o.rank))}")
    culprit = replay.culprit if replay is not None else None
    top = tuple(sorted(r for r, n in named.items() if n == max(named.values()))) if named else ()
    if died:
        culprits = tuple(died)
    elif len(top) > 1 and replay is not None and culprit is not None and culprit["decided"] and culprit["ranks"]:
        # The errors name each other (the first to time out names a silent peer, which then loses it and
        # names the first): they cannot decide, and replay's rule over the traces can.
        culprits = tuple(culprit["ranks"])
        lines.append(f"from the traces: {replay.verdict}: {replay.headline}")
    elif top:
        culprits = top
    elif replay is not None and culprit is not None and (culprit["ranks"] or not culprit["decided"]):
        # Undecided: the traces cannot tell the suspects apart, and a guess is no culprit.
        culprits = tuple(culprit["ranks"])
        lines.append(f"from the traces: {replay.verdict}: {replay.headline}")
    else:
        culprits = tuple(o.rank for o in outcomes if o.error is not None)
    head = f"culprit: rank {', '.join(map(str, culprits))}" if culprits else "culprit: unknown"
    return culprits, "\n".join([head, *("  " + line for line in lines)])


def unnoticed_text(faults: Sequence[Injection], ranks: int) -> str:
    """Why injected faults went unnoticed, in words: the same fault on every rank, or a detector that missed."""
    named = ", ".join(map(str, faults))
    alike = {(i.kind, i.step) for i in faults
             if {j.rank for j in faults if (j.kind, j.step) == (i.kind, i.step)} == set(range(ranks))}  # fmt: skip
    if alike:
        what = "; ".join(f"{kind} on every rank at step {step}" for kind, step in sorted(alike, key=lambda a: a[1]))
        why = (f"the fault struck every rank alike ({what}), and the guards and checks compare the ranks with "
               "each other: ranks that are wrong alike still agree. Inject it on fewer ranks than all")  # fmt: skip
    else:
        why = "no guard or check caught them; that is a detector's miss: replay the traces and report it"
    return f"the injected fault(s) {named} went unnoticed: every rank finished every step verified; {why}"


def trace_end(t: RankTrace | None) -> str:
    """The last record of a rank's trace, in words: event, the action or trigger it names, state, epoch."""
    if t is None or not t.records:
        return "nothing (no trace)"
    event, what, _ = last_own_record(t)
    then = ", then its stop's trace_closed" if stopped_from_outside(t) is not None else ""
    return f"{event} {what or ''} in {t.state} (epoch {t.epoch}){then}".replace("  ", " ")


def _clip(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running when killed"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


# ---------------------------------------------------------------- print


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def print_result(result: DemoResult, out: Any) -> None:
    """The summary table (on success) or the diagnosis (on failure), then the trace directory."""
    from rich.table import Table

    c = result.config
    if result.ok:
        table = Table(title=f"miles-fsm demo: {c.ranks} ranks x {c.steps} steps, {c.mode.value}, every cycle verified")
        table.add_column("phase", justify="left")
        for col in ("n", "median", "bytes moved", "peak device", "host held"):
            table.add_column(col, justify="right")
        for row in result.summary():
            table.add_row(
                row["name"], str(row["count"]), f"{row['median_s'] * 1e3:.2f} ms", _human(row["bytes_moved"]),
                _human(row["peak_bytes"]), _human(row["host_bytes"]),
            )
        out.print(table)
        h = result.held()
        out.print(
            f"host bytes held while PAUSED ({c.mode.value}), per rank: actor copy {_human(h.get('actor'))} "
            f"(of which bf16 params {_human(h.get('actor_bf16_params'))}; the bf16 params are "
            f"{_human(h.get('bf16_params'))}), ref copy {_human(h.get('ref'))}, "
            f"optimizer-state backup {_human(h.get('saver_backups'))}"
        )
        out.print(f"OK: {sum(result.verified.values())} cycles verified bit-exact in {result.wall_s:.1f} s")
        for f in result.drift():
            out.print(f"memory drift (live check): rank {f['rank']}: {f['kind']} memory under {f['tag']!r} grows "
                      f"{_human(f['bytes_per_cycle'])}/cycle from cycle {f['first_cycle']} (at {f['state']})",
                      markup=False)  # fmt: skip
        note, leak = result.drift_unjudged
        if note is not None:
            out.print(f"{'FAILED' if leak else 'NOTE'}: {note}", markup=False)
    elif result.unnoticed:
        out.print(f"FAILED after {result.wall_s:.1f} s: {unnoticed_text(result.unnoticed, c.ranks)}", markup=False)
    else:
        out.print(f"FAILED after {result.wall_s:.1f} s; {result.diagnosis}", markup=False)
    out.print(f"traces: {c.trace_dir}  (miles-fsm replay {c.trace_dir})", markup=False)
