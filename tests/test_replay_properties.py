"""Property tests of ``miles-fsm replay``: healthy runs, one fault, then random damage to the files.

Each example writes a healthy multi-rank run (``trace_writer``), maybe one
fault (a rank that plans another tensor set, or stops mid-transition), then
damages the files: a rank truncated at a random byte, records deleted,
duplicated or shuffled, garbage or hostile lines inserted, ``trace_closed``
dropped, a stale file of another run added. Whatever the damage, replay
never raises, exits 0, 2 or 3 with JSON that parses, says ``ok`` only for a
run that is healthy once its lines are sorted and de-duplicated, and names
the faulty rank when the evidence is undamaged.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from miles_fsm.apps.cli import main
from test_trace_index import same_but_the_change
from trace_writer import RUN, RankWriter, healthy

_HOSTILE = [
    b"garbage",
    b"{",
    b'{"event":"action_started"}',
    b'{"event":"action_finished","seq":"x"} trailing',
    b'{"v":2,"event":"transition_started","seq":1e400}',
    b'{"v":2,"event":"guard_failed","seq":3,"duration_s":NaN}',
    b'{"v":2,"run":"%s","event":"demo_failed","seq":%d,"error":{"x":[1]},"culprits":[1]}',
    b'{"v":2,"run":"%s","event":"transition_started","seq":%d,"trigger":["sync"],"steps":[{}]}',
    b'{"v":2,"run":"%s","event":"trace_closed","seq":%d,"clean":"yes"}',
    b'{"x":' + b"[" * 40 + b"]" * 40 + b"}",
    b'{"v":2,"run":"%s","event":"demo_step","seq":%d,"world":18446744073709551615,"epoch":-99999999999999999999}',
]

damage = st.tuples(
    st.sampled_from(["truncate", "delete", "duplicate", "shuffle", "insert", "drop_close", "stale_run"]),
    st.integers(0, 10**6),
)


def _hostile(n: int) -> bytes:
    line = _HOSTILE[n % len(_HOSTILE)]
    return line.replace(b"%s", RUN.encode()).replace(b"%d", str(n % 97).encode())


def _lines(root: Path, rank: int) -> list[bytes]:
    return [ln for ln in (root / f"rank-{rank}.jsonl").read_bytes().split(b"\n") if ln.strip()]


def _apply(root: Path, world: int, kind: str, n: int) -> None:
    rnd = random.Random(n)
    path = root / f"rank-{n % world}.jsonl"
    lines = path.read_bytes().splitlines()
    if kind == "truncate":
        data = b"\n".join(lines) + b"\n"
        path.write_bytes(data[: rnd.randrange(len(data) + 1)])
        return
    if kind == "delete" and lines:
        del lines[rnd.randrange(len(lines))]
    elif kind == "duplicate" and lines:
        lines.insert(rnd.randrange(len(lines) + 1), lines[rnd.randrange(len(lines))])
    elif kind == "shuffle":
        rnd.shuffle(lines)
    elif kind == "insert":
        lines.insert(rnd.randrange(len(lines) + 1), _hostile(n))
    elif kind == "drop_close":
        lines = [ln for ln in lines if b'"event":"trace_closed"' not in ln]
    elif kind == "stale_run":
        stale = RankWriter(world, world + 1, run="an-older-run")
        stale.cycles(1)
        stale.write(root)
        return
    path.write_bytes(b"\n".join(lines) + b"\n")


def _replay(capsys, root: Path, *extra: str) -> tuple[int, dict[str, Any] | None]:
    code = main(["replay", str(root), "--json", *extra])
    out = capsys.readouterr().out
    return code, orjson.loads(out) if out else None


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(2, 4),
    cycles=st.integers(1, 2),
    fault=st.sampled_from([None, "diverge", "stop"]),
    at=st.integers(0, 10**6),
    damages=st.lists(damage, max_size=3),
)
# A lost action line and a copy of a later one in its place: the line count still adds up (found by this test).
@example(world=2, cycles=2, fault=None, at=0, damages=[("delete", 0), ("duplicate", 0)])
# Both files cut inside their first line: nothing readable is bad input, not a crash (found by this test).
@example(world=2, cycles=1, fault=None, at=0, damages=[("truncate", 281), ("truncate", 10068)])
def test_damaged_traces_never_crash_and_ok_means_healthy(capsys, world, cycles, fault, at, damages):
    """Any damage: exit 0/2/3, JSON parses, ok only if healthy and nothing lost, the culprit when undamaged."""
    culprit = at % world
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if fault is None:
            healthy(root, world=world, cycles=cycles)
        for r in range(world) if fault is not None else ():
            w = RankWriter(r, world)
            per = {}
            if r == culprit and fault == "diverge":
                per = {"sync": {"tensors": "e" * 32}}
            elif r == culprit:
                per = {"rematerialize": {"stop": "planning"}}
            w.cycles(cycles)  # agreed first, so a 1-vs-1 divergence is not a tie
            w.cycles(1, **per)
            w.write(root)
        written = [set(_lines(root, r)) for r in range(world)]
        for kind, n in damages:
            _apply(root, world, kind, n)
        kinds = {k for k, _ in damages}
        # Nothing lost, nothing added: every rank file holds exactly its records, maybe shuffled or repeated.
        intact = all(set(_lines(root, r)) == written[r] for r in range(world))
        code, d = _replay(capsys, root)
        assert code in (0, 2, 3)
        if code == 2:
            # Bad input only for mixed runs, or when no file holds one whole line (each cut inside its first).
            assert "stale_run" in kinds or all(b"\n" not in p.read_bytes().strip() for p in root.glob("rank-*.jsonl"))
            if "stale_run" in kinds:
                code, d = _replay(capsys, root, "--run", RUN)
                assert code in (0, 2, 3)
            if code == 2:
                return
        assert d is not None and d["verdict"] in ("ok", "divergence", "stuck", "crashed", "corrupt", "incomplete")
        assert (code == 0) == (d["verdict"] == "ok")
        if d["verdict"] == "ok":
            assert fault is None and intact, (damages, d["headline"])
        if fault is None and intact:
            assert d["verdict"] == "ok", (damages, d["headline"])
        if fault is not None and intact:
            assert d["culprit"]["ranks"] == [culprit], (fault, damages, d["headline"])
            assert d["verdict"] == ("divergence" if fault == "diverge" else "incomplete"), d["headline"]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(2, 3),
    fault=st.sampled_from([None, "diverge", "stop"]),
    damages=st.lists(damage, max_size=2),
)
# Damage that keeps a file's size (a shuffle): only the CRC tells the index is stale.
@example(world=2, fault=None, damages=[("shuffle", 1)])
def test_an_index_never_changes_what_replay_says(capsys, world, fault, damages):
    """Indexes written at close, then any damage: replay says exactly what it says from the lines alone."""
    from miles_fsm.trace_index import write_index

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for r in range(world):
            w = RankWriter(r, world)
            w.cycles(1)
            if r == 0 and fault == "diverge":
                w.cycles(1, sync={"tensors": "e" * 32})
            elif r == 0 and fault == "stop":
                w.cycles(1, rematerialize={"stop": "planning"})
            else:
                w.cycles(1)
            w.write(root)
            write_index(root / f"rank-{r}.jsonl", r)
        closed = {p.name: p.read_bytes() for p in root.glob("rank-*.jsonl")}
        for kind, n in damages:
            _apply(root, world, kind, n)
        changed = {p.name for p in root.glob("rank-*.jsonl") if p.name in closed and p.read_bytes() != closed[p.name]}
        indexed = _replay(capsys, root)
        for p in root.glob("*.index"):
            p.unlink()
        alone = _replay(capsys, root)
        if not changed:
            assert alone == indexed, damages
            return
        # A trace changed after close: never ok with its index, which says so; else what the lines alone say.
        if indexed[0] == 2:
            assert alone == indexed, damages
            return
        said = {Path(x["file"]).name for x in indexed[1]["trace_problems"]["damaged"] if "closed it" in x["reason"]}
        assert indexed[0] == 3 and said == changed, damages
        if alone[0] == 3:
            assert same_but_the_change(indexed[1], alone[1]), damages
