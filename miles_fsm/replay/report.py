"""``miles-fsm replay DIR``: why a job hung, diverged or corrupted, from its per-rank traces.

Reads ``DIR/rank-<r>.jsonl`` (``miles_fsm.replay.read``), diagnoses across
ranks (``miles_fsm.replay.diagnose``) and prints a one-line verdict, then the
details; ``--json`` prints the contract object instead, and ``--perfetto``
writes a timeline (``miles_fsm.replay.perfetto``).

Exit codes: 0 healthy, 3 a problem diagnosed, 2 bad input.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from miles_fsm.errors import list_names
from miles_fsm.flight_recorder import FlightRecorderError
from miles_fsm.ranks import plural_ranks
from miles_fsm.replay.diagnose import Diagnosis, diagnose, rank_ranges
from miles_fsm.replay.evidence import first_line
from miles_fsm.replay.files import rank_files
from miles_fsm.replay.fr_align import FrReport, explain
from miles_fsm.replay.leaks import find_leaks, leak_lines, leak_note, memory_series, unjudged_note
from miles_fsm.replay.model import EpochRange, TraceDirError
from miles_fsm.replay.notes import undeclared_note, unproven_note
from miles_fsm.replay.perfetto import check_output
from miles_fsm.replay.read import read_ranks
from miles_fsm.replay.runs import choose_run
from miles_fsm.replay.shapes import RankEntry

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_PROBLEM", "render", "replay"]

EXIT_OK = 0
EXIT_PROBLEM = 3
EXIT_BAD_INPUT = 2

_LIST_LIMIT = 20


def replay(
    trace_dir: str,
    *,
    ranks: Iterable[int] | None = None,
    epochs: EpochRange | None = None,
    workers: int | None = None,
    straggler_ratio: float = 1.5,
    perfetto: str | None = None,
    run: str | None = None,
    flight_recorder: str | None = None,
    fr_prefix: str | None = None,
) -> Diagnosis:
    """Read and diagnose a trace directory (of one run: ``run``, when it holds several).

    ``flight_recorder``: a folder of ``fr-rank-<r>.json`` dumps, or of torch's own
    (``<fr_prefix><rank>``), (None: those beside the traces, if any); what they
    say is ``Diagnosis.flight_recorder``.

    Raises ``TraceDirError`` (``MixedRunsError`` among them), ``OutputPathError``
    or ``FlightRecorderError`` on bad input.
    """
    found = rank_files(trace_dir)
    files = found.files
    if flight_recorder is not None and not os.path.isdir(flight_recorder):  # before the long read
        raise FlightRecorderError(path=str(flight_recorder), reason="not a directory")
    if perfetto is not None:
        # Before the long read, not after it; nothing of the run's evidence may be overwritten.
        check_output(perfetto, files.values(), folders=[trace_dir] + ([flight_recorder] if flight_recorder else []))
    wanted = None if ranks is None else sorted(set(ranks))
    if wanted is not None:
        files = {r: p for r, p in files.items() if r in wanted}
        if not files:
            raise TraceDirError(trace_dir, f"holds no trace for rank(s) {rank_ranges(wanted)}")
    chosen = choose_run(trace_dir, read_ranks(files, epochs=epochs, workers=workers, run=run), run)
    traces = chosen.traces
    if not any(t.records for t in traces):
        raise TraceDirError(trace_dir, "its trace files hold no readable record")
    if epochs is not None and not any(t.positions or t.notes for t in traces):
        last = max(t.epoch for t in traces)
        raise TraceDirError(trace_dir, f"--epoch {epochs} selects nothing: its traces hold epochs 0-{last}")
    diagnosis = diagnose(traces, expected=wanted, straggler_ratio=straggler_ratio, run=chosen.run,
                         ignored=chosen.ignored, warnings=chosen.warnings, misnamed=found.misnamed)  # fmt: skip
    memory = memory_series(files, run=chosen.run)
    leaks = find_leaks(memory)
    if leaks:  # beside the verdict: the verdict set is fixed, a leak is a finding of its own (exit 3)
        diagnosis = dataclasses.replace(diagnosis, leaks=leaks, notes=[*diagnosis.notes, leak_note(leaks)])
    elif (unjudged := unjudged_note(memory)) is not None:  # a run too short to judge says so
        diagnosis = dataclasses.replace(diagnosis, notes=[*diagnosis.notes, unjudged])
    unproven = [t for t in traces if not t.proven]
    if unproven:  # never a silent ok: what the lines alone cannot show is said
        diagnosis = dataclasses.replace(diagnosis, notes=[*diagnosis.notes, unproven_note(unproven, len(traces))])
    report = explain(files, flight_recorder, run=chosen.run, prefix=fr_prefix)
    if perfetto is not None:
        from miles_fsm.replay.perfetto import export_perfetto

        export_perfetto(traces, perfetto, epochs=epochs,
                        collectives=report.to_json()["ranks"] if report is not None else ())  # fmt: skip
    return with_flight_recorder(diagnosis, report)


def with_flight_recorder(d: Diagnosis, report: FrReport | None) -> Diagnosis:
    """``d`` with what the Flight Recorder dumps say (a mismatch of collectives is a problem: exit 3)."""
    if report is None:
        return d
    rogue = sorted(r.rank for r in report.ranks if r.declared is False)
    notes = [*d.notes, undeclared_note(d, rogue)] if rogue else d.notes
    return dataclasses.replace(d, flight_recorder=report.to_json(), notes=notes)


# -------------------------------------------------------------------- report

_STYLE = {
    "ok": "bold green",
    "divergence": "bold red",
    "stuck": "bold red",
    "crashed": "bold red",
    "corrupt": "bold red",
    "incomplete": "bold yellow",
}


def render(d: Diagnosis, out: TextIO, *, rich: bool | None = None) -> None:
    """The human report: a one-line verdict, then details. Rich on a terminal, plain otherwise."""
    lines = report_lines(d)
    use_rich = out.isatty() if rich is None else rich
    if not use_rich:
        out.write("\n".join(text for _, text in lines) + "\n")
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(file=out, highlight=False, soft_wrap=True)
    for style, text in lines:
        console.print(Text(text, style=style or ""))


def report_lines(d: Diagnosis) -> list[tuple[str | None, str]]:
    """(style, text) lines of the report; the first is the verdict."""
    L: list[tuple[str | None, str]] = [(_STYLE[d.verdict], f"{d.word}: {d.headline}")]
    for section in _SECTIONS:
        section(d, L)
    return L


def _summary(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """The flight recorder's line, the culprit and the notes, under the verdict."""
    add = L.append
    fr = d.flight_recorder
    if fr is not None:
        add(("bold red" if fr["mismatch"] else None, f"flight recorder: {fr['line']}"))
        for problem in fr["problems"]:
            add(("yellow", f"  flight recorder: {problem}"))
        for g in fr.get("groups") or ():  # torch's alignment, for torch-format dumps
            if g["kind"] is not None:
                add(("bold red", f"  torchfrtrace: {g['desc'] or g['name']}: {g['kind']} at {g['op']} "
                                 f"#{g['collective_seq_id']}: {g['line']}"))
    if d.culprit is not None:
        c = d.culprit
        if c["decided"]:
            who = f"rank(s) {rank_ranges(c['ranks'])}"
        elif c["suspects"]:
            who = f"undecided (suspects: {rank_ranges(c['suspects'])})"
        else:
            who = "none: nothing recorded singles out a rank"
        where = f" | transition {c['transition']}" if c["transition"] else " | between transitions"
        add((None, f"  culprit: {who} | epoch {c['epoch']}{where}"))
    for n in d.notes:
        add(("dim", f"  note: {n}"))


def _ranks(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """Every rank's status, ranks alike grouped."""
    add = L.append
    add(("bold", f"\nRanks (world {d.world}, {sum(1 for r in d.ranks if r['status'] != 'missing')} traces)"))
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for r in d.ranks:
        groups[_rank_key(r)].append(r["rank"])
    for key, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        add((None, f"  {plural_ranks(ranks)}: {key[0]}"))


def _first_divergence(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """Where the ranks' plans first differ, and whom that suspects."""
    add = L.append
    if d.first_divergence is not None:
        f = d.first_divergence
        add(("bold", "\nFirst divergence"))
        where = f"{f['transition']} (epoch {f['epoch']}, transition #{f['position']})"
        add((None, f"  {where}: they differ in {', '.join(x['field'] for x in f['differences'])}"))
        for diff in f["differences"]:
            add((None, f"    {diff['field']}:"))
            for group in diff["groups"]:
                add((None, f"      {plural_ranks(group['ranks'])}: {_value(group['value'])}"))
        caught = f.get("guard_report")
        if caught is not None:
            detail = f": {'; '.join(caught['detail'])}" if caught["detail"] else ""
            add((None, f"    the guard caught it, on {caught['field']}{detail}"))
        if not f["decided"]:
            add(("yellow", f"    {f['reason']}: suspect every rank of the differing groups "
                           f"({rank_ranges(f['culprits'])}), none is singled out"))
        else:
            add((None, f"    suspect {plural_ranks(f['culprits'])} ({f['how']}): {f['reason']}"))
        if f["not_yet_at_guard"]:
            add(("dim", f"    {plural_ranks(f['not_yet_at_guard'])} had not reached the guard, so their plan is unknown"))


def _stopped(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """Ranks that crashed or are stuck, and the evidence."""
    add = L.append
    if d.stuck:
        add(("bold", "\nStopped ranks"))
        for s in d.stuck[:_LIST_LIMIT]:
            add((None, f"  {s['summary']}"))
            add(("dim", f"    crashed or stuck: {s['how']}: {s['evidence']}"))
        _more(L, d.stuck)


def _verification(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """Verification failures, ranks alike grouped."""
    add = L.append
    if d.verification:
        add(("bold", "\nVerification failures"))
        grouped: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for v in d.verification:
            grouped[(v["epoch"], v["transition"], v["where"], tuple(v["tensors"]))].append(v["rank"])
        for (epoch, trigger, where, tensors), ranks in list(grouped.items())[:_LIST_LIMIT]:
            add((None, f"  {plural_ranks(ranks)}, {trigger} (epoch {epoch}, {where}): {len(tensors)} tensor(s): "
                       f"{list_names(list(tensors))}"))


def _failed_actions(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """Failed actions other than verification."""
    add = L.append
    if d.failures:
        shown = [f for f in d.failures if not f["verification"]]
        if shown:
            add(("bold", "\nFailed actions"))
            for f in shown[:_LIST_LIMIT]:
                add((None, f"  rank {f['rank']}: {f['action']} of {f['transition']} (epoch {f['epoch']}): "
                           f"{f['error']}: {first_line(f['message'] or '')}"))
            _more(L, shown)


def _outside_failures(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """Failures outside the lifecycle's transitions."""
    add = L.append
    # A rank already FAILED by a transition carries that failure out of its step and its lifecycle: shown above.
    outside = [f for f in d.outside_failures if not f["after_failed"]]
    if outside:
        add(("bold", "\nFailures outside the lifecycle's transitions"))
        for f in outside[:_LIST_LIMIT]:
            where = f" in {f['where']}" if f["where"] else ""
            named = f", naming {plural_ranks(f['culprits'])}" if f["culprits"] else ""
            add((None, f"  rank {f['rank']}{where} (epoch {f['epoch']}, {f['event']}): {f['error'] or 'an error'}: "
                       f"{f['message']}{named}"))
        _more(L, outside)


def _guard_failures(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """Guard failures, and whom they name."""
    add = L.append
    if d.guard_failures:
        add(("bold", "\nGuard failures"))
        for g in d.guard_failures[:_LIST_LIMIT]:
            extra = ""
            if g["missing"]:
                extra = f", naming rank(s) {rank_ranges(g['missing'])} as missing"
            elif g.get("field"):
                culprits = g.get("culprits")
                extra = f", on {g['field']}" + (f" (suspects: {rank_ranges(culprits)})" if culprits else "")
            add((None, f"  {g['transition']} (epoch {g['epoch']}): {g['error']} on {plural_ranks(g['ranks'])}{extra}"))
        _more(L, d.guard_failures)


def _illegal(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """Transitions the definition does not allow."""
    add = L.append
    add(("bold", "\nIllegal transitions (re-driven through the lifecycle definition)"))
    if not d.illegal:
        add((None, "  none: every recorded transition is one the machine allows"))
    for i in d.illegal[:_LIST_LIMIT]:
        add((None, f"  rank {i['rank']} line {i['line']} (epoch {i['epoch']}, {i['trigger']}): {i['reason']}"))
    _more(L, d.illegal)


def _stragglers(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """Ranks slower than the median by the threshold."""
    add = L.append
    flagged = [s for s in d.stragglers if s["straggler"]]
    add(("bold", "\nStragglers (own work time per transition, guard wait excluded)"))
    if not d.stragglers:
        add((None, "  not enough finished transitions to compare"))
    elif not flagged:
        worst = max(d.stragglers, key=lambda s: s["ratio"] or 0.0)
        add((None, f"  none: the slowest rank is within the threshold of the median on every transition "
                   f"(worst: {worst['transition']}, rank {worst['slowest_rank']}, {_ratio(worst['ratio'])})"))
    for s in flagged:
        line = (
            f"  {s['transition']} (x{s['instances']}): rank {s['slowest_rank']} {_secs(s['slowest_s'])} "
            f"vs median {_secs(s['median_s'])} ({_ratio(s['ratio'])})"
        )
        w = s.get("worst")
        if w:
            line += f"; worst once: rank {w['rank']} at epoch {w['epoch']}, {_ratio(w['ratio'])}"
        add(("yellow", line))


def _trace_problems(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    """What could not be read, or is missing."""
    add = L.append
    tp = d.trace_problems
    problems = tp["bad_lines"] or tp["truncated"] or tp["lost_records"] or tp["warnings"] or tp["ignored"] \
        or d.missing_ranks or tp["damaged"]  # fmt: skip
    if problems:
        add(("bold", "\nTrace problems"))
        for x in tp["damaged"][:_LIST_LIMIT]:
            add((None, f"  {x['where']}: damaged: {x['reason']}"))
        _more(L, tp["damaged"])
        if d.missing_ranks:
            add((None, f"  no trace file for {plural_ranks(d.missing_ranks)}"))
        for b in tp["bad_lines"][:_LIST_LIMIT]:
            add((None, f"  {b['where']}: {b['reason']}, skipped: {b['text'][:60]!r}"))
        _more(L, tp["bad_lines"])
        for cut in tp["truncated"]:
            add((None, f"  {cut['where']}: truncated last line (the process stopped while writing it), skipped"))
        for rank, n in list(tp["lost_records"].items())[:_LIST_LIMIT]:
            add((None, f"  rank {rank}: {n} record(s) missing by sequence number"))
        for path in tp["ignored"][:_LIST_LIMIT]:
            add((None, f"  {path}: ignored, it holds another run than {tp['run']}"))
        for w in tp["warnings"][:_LIST_LIMIT]:
            add((None, f"  {w}"))


# The report's sections, in the order they print.
def _leaks(d: Diagnosis, L: list[tuple[str | None, str]]) -> None:
    L.extend(leak_lines(d.leaks))


_SECTIONS = (_summary, _ranks, _first_divergence, _stopped, _verification, _failed_actions, _outside_failures,
             _guard_failures, _illegal, _leaks, _stragglers, _trace_problems)

def _rank_key(r: RankEntry) -> tuple[str]:
    if r["status"] == "missing":
        return ("no trace file",)
    text = f"{r['status']}, {r['state']}, epoch {r['epoch']}, {r['transitions']} transitions"
    if "inside" in r:
        i = r["inside"]
        text += {
            "planning": f", inside {i['transition']} before its guard",
            "guard": f", inside the guard of {i['transition']}",
            "step": f", inside action {i['action']} of {i['transition']}",
            "between steps": f", inside {i['transition']} after action {i['action']}",
        }.get(i["phase"], f", inside {i['transition']}")
    if "error" in r:
        e = r["error"]
        text += f", {e['type']} in {e['action'] or 'guard'} of {e['transition']}"
        if e["epoch"] != r["epoch"]:  # the rank's epoch is its last committed one; the failed transition's is its own
            text += f" (epoch {e['epoch']})"
    text += _CLOSED.get(r["closed"], ", no trace_closed (cut off, or still running)")
    return (text,)


#: How a rank's trace was closed, in its line of the report (None: cut off).
_CLOSED: dict[str | None, str] = {"clean": "", "unclean": ", trace closed on an error"}


def _more(lines: list[tuple[str | None, str]], items: Sequence[Any]) -> None:
    if len(items) > _LIST_LIMIT:
        lines.append(("dim", f"  ... and {len(items) - _LIST_LIMIT} more (see --json)"))


def _value(v: Any) -> str:
    if isinstance(v, list):
        return ", ".join(map(str, v)) if v else "(none)"
    return "(none)" if v is None else str(v)


def _secs(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x the median"
