"""The damage sweep: every kind of damage and every single-field edit of a healthy run, replayed with and without
its index. Counts false oks, tracebacks, hangs and the peak RSS.

    python benchmarks/sweep_damage.py --out benchmarks/results/damage_sweep_cpu.json

The run is the one ``tests/test_replay_edit_properties.py`` edits: two
ranks, two cycles, a record of every kind a run writes (``trace_opened``,
transitions, guards in a transition and outside one, actions,
``verified``, ``memory_snapshot``, a driver's own ``demo_step``,
``trace_closed``), closed with the index its writer leaves.

- **Single-field edits**: for each (event, field) of rank 1's records (the
  first record of each event, and the second, whose context differs), each
  edit of ``OPS`` (remove, null, another type, out-of-range numbers,
  another plausible value, a ``culprits`` list added).
- **Damage kinds**: each line of rank 1 deleted, duplicated, moved after
  the next, cut in its middle (the tail then lost), a blank line before
  it, each of the hostile lines of ``tests/test_replay_properties.py``
  put before it; and whole files: ``trace_closed`` dropped, a stale rank
  file of another run, a copy, a symlink and a swap of two ranks' files.

Each case is replayed in this process (``miles_fsm.replay.report.replay``)
with the indexes and without them. A *false ok* is exit 0 on a changed
input: with the index, any; without it, any but the edits no line can show
(``invisible``), which must then carry the "not provable without the
index" note. A *traceback* is an exception other than bad input (exit 1);
a *hang*, a case past ``--limit`` seconds (SIGALRM).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]
from test_replay_edit_properties import OPS, UNPROVEN, WORLD, _base, invisible  # noqa: E402
from test_replay_properties import _HOSTILE  # noqa: E402
from trace_writer import RUN, RankWriter  # noqa: E402

from miles_fsm.replay.model import TraceDirError  # noqa: E402
from miles_fsm.replay.report import replay  # noqa: E402

_DELETE_OP = "delete"
#: Damage replay accounts for and reads ok, with a warning: an exact duplicate (dropped) and lines out of ``seq``
#: order (read sorted). docs/replay.md, "Reading".
_ACCOUNTED = ("duplicate a line", "move a line after the next")
_WHOLE = ("a stale file of another run", "copy of another rank's file", "symlink of another rank's file",
          "swap of another rank's file")


class _Hang(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hang


def _edits() -> Iterator[tuple[str, str, Callable[[Path], None], bool]]:
    """(kind, case, edit of the directory, invisible) for every single-field edit of rank 1."""
    lines = _base()[f"rank-{1}.jsonl"].splitlines()
    recs = [orjson.loads(ln) for ln in lines]
    seen: Counter[str] = Counter()
    for i, rec in enumerate(recs):
        seen[rec["event"]] += 1
        if seen[rec["event"]] > 2:
            continue
        for field in sorted({*rec, "culprits"}):
            for op, make in OPS.items():
                if (field == "culprits") != (op == "culprits"):
                    continue
                value = make(rec.get(field))
                new = {k: v for k, v in rec.items() if k != field} if op == _DELETE_OP else {**rec, field: value}
                if new == rec:
                    continue
                line = json.dumps(new, separators=(",", ":")).encode()

                def edit(root: Path, i: int = i, line: bytes = line) -> None:
                    _replace(root, lambda ls: [*ls[:i], line, *ls[i + 1 :]])

                yield f"edit {rec['event']}.{field}", f"{op} (line {i + 1})", edit, invisible(rec["event"], field, op,
                                                                                              rec)  # fmt: skip


def _damages() -> Iterator[tuple[str, str, Callable[[Path], None], bool]]:
    """(kind, case, edit, invisible) for every damage kind: per line of rank 1, then whole files."""
    n = len(_base()[f"rank-{1}.jsonl"].splitlines())
    per_line: dict[str, Callable[[list[bytes], int], list[bytes]]] = {
        "delete a line": lambda ls, i: ls[:i] + ls[i + 1 :],
        "duplicate a line": lambda ls, i: ls[: i + 1] + ls[i:],
        "move a line after the next": lambda ls, i: ls[:i] + ls[i + 1 : i + 2] + ls[i : i + 1] + ls[i + 2 :],
        "cut inside a line": lambda ls, i: [*ls[:i], ls[i][: len(ls[i]) // 2]],
        "a blank line": lambda ls, i: [*ls[:i], b"", *ls[i:]],
    }
    for k, h in enumerate(_HOSTILE):
        hostile = h.replace(b"%s", RUN.encode()).replace(b"%d", b"5")
        per_line[f"hostile line {k}"] = lambda ls, i, x=hostile: [*ls[:i], x, *ls[i:]]
    for kind, f in per_line.items():
        whole = kind != "cut inside a line"  # a cut leaves the file without its last newline
        for i in range(n):
            yield kind, f"at line {i + 1}", lambda root, f=f, i=i, w=whole: _replace(root, lambda ls: f(ls, i), w), \
                False  # fmt: skip
    yield "drop trace_closed", "rank 1", lambda root: _replace(root, lambda ls: ls[:-1]), False
    yield "a stale file of another run", "rank 2", _stale, False
    for how in ("copy", "symlink", "swap"):
        yield f"{how} of another rank's file", "ranks 0, 1", lambda root, how=how: _whole(root, how), False


def _replace(root: Path, edit: Callable[[list[bytes]], list[bytes]], newline: bool = True) -> None:
    p = root / "rank-1.jsonl"
    p.write_bytes(b"\n".join(edit(p.read_bytes().splitlines())) + (b"\n" if newline else b""))


def _stale(root: Path) -> None:
    w = RankWriter(WORLD, WORLD + 1, run="an-older-run")
    w.cycles(1)
    w.write(root)


def _whole(root: Path, how: str) -> None:
    zero, one = root / "rank-0.jsonl", root / "rank-1.jsonl"
    if how == "swap":
        a, b = zero.read_bytes(), one.read_bytes()
        zero.write_bytes(b)
        one.write_bytes(a)
        return
    one.unlink()
    if how == "copy":
        one.write_bytes(zero.read_bytes())
    else:
        os.symlink(zero.name, one)


def _said(root: Path, limit: int) -> tuple[str, int | None, bool]:
    """(outcome, exit code, whether an ok says it is not provable): outcome ok, problem, bad input, traceback, hang."""
    signal.alarm(limit)
    try:
        d = replay(str(root), workers=1)
    except TraceDirError:
        return "bad input", 2, False
    except _Hang:
        return "hang", None, False
    except Exception as exc:  # a traceback is what the sweep counts, and names
        return f"traceback: {type(exc).__name__}: {exc}", 1, False
    finally:
        signal.alarm(0)
    return ("ok" if d.exit_code == 0 else "problem"), d.exit_code, any(n.startswith(UNPROVEN) for n in d.notes)


def sweep(limit: int) -> dict[str, Any]:
    signal.signal(signal.SIGALRM, _on_alarm)
    out: dict[str, Any] = {"cases": 0, "kinds": set(), "false_ok_with_index": [], "false_ok_without_index": [],
                           "ok_unseen_and_said": 0, "ok_unseen_not_said": [], "ok_accounted_for": [], "tracebacks": [], "hangs": [],
                           "slowest_case_s": 0.0}  # fmt: skip
    t0 = time.perf_counter()
    for group, cases in (("single-field edits", _edits()), ("damage kinds", _damages())):
        n = 0
        for kind, case, edit, unseen in cases:
            n += 1
            out["kinds"].add(kind)
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp)
                for name, data in _base().items():
                    (root / name).write_bytes(data)
                before = (root / "rank-1.jsonl").read_bytes()
                edit(root)
                if (root / "rank-1.jsonl").exists() and not (root / "rank-1.jsonl").is_symlink() and \
                        (root / "rank-1.jsonl").read_bytes() == before and kind not in _WHOLE:  # fmt: skip
                    n -= 1
                    continue  # the edit changed nothing (the last line moved after no next one)
                for indexed in (True, False):
                    if not indexed:
                        for p in root.glob("*.index"):
                            p.unlink()
                    start = time.perf_counter()
                    outcome, _, said = _said(root, limit)
                    out["slowest_case_s"] = max(out["slowest_case_s"], time.perf_counter() - start)
                    name = f"{kind}: {case}" + ("" if indexed else " (no index)")
                    if outcome.startswith("traceback"):
                        out["tracebacks"].append(f"{name}: {outcome}")
                    elif outcome == "hang":
                        out["hangs"].append(name)
                    elif outcome == "ok" and indexed:
                        out["false_ok_with_index"].append(name)
                    elif outcome == "ok" and kind in _ACCOUNTED:
                        out["ok_accounted_for"].append(name)
                    elif outcome == "ok" and not unseen:
                        out["false_ok_without_index"].append(name)
                    elif outcome == "ok" and said:
                        out["ok_unseen_and_said"] += 1
                    elif outcome == "ok":
                        out["ok_unseen_not_said"].append(name)
        out[group] = n
        out["cases"] += n
    out["kinds"] = len(out["kinds"])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures here as JSON")
    ap.add_argument("--limit", type=int, default=10, help="seconds a case may take before it counts as a hang")
    args = ap.parse_args()
    figures = {"benchmark": "damage sweep", "command": " ".join(sys.argv), **sweep(args.limit)}
    # A long list of cases is kept as its count and its first ones: the figures are the counts.
    kept = {k: {"count": len(v), "first": v[:40]} if isinstance(v, list) and len(v) > 40 else v
            for k, v in figures.items()}  # fmt: skip
    text = json.dumps(kept, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    short = {k: (len(v) if isinstance(v, list) else v) for k, v in figures.items()}
    print(json.dumps(short, indent=2))


if __name__ == "__main__":
    main()
