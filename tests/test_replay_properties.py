"""Property tests of ``miles-fsm replay``: healthy runs, one fault, then random damage to the files.

Each example writes a healthy multi-rank run (``trace_writer``), maybe one
fault (a rank that plans another tensor set, or stops mid-transition), then
damages the files: a rank truncated at a random byte, records deleted,
duplicated or shuffled, garbage or hostile lines inserted, ``trace_closed``
dropped, a stale file of another run added, an action record or any
record's identity (``rank``, ``run``, ``world``, ``v``) edited, a bit
flipped in a record's structure or identity, a rank file copied, linked or
swapped with another's. Whatever the damage, replay never raises, exits 0,
2 or 3 with JSON that parses, says ``ok`` only for a run that is healthy
once its lines are sorted and de-duplicated, and names the faulty rank when
the evidence is undamaged. A closed trace (with its index) is never ok after
any single bit flip.
"""

from __future__ import annotations

import os
import random
import re
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

_KINDS = ["truncate", "delete", "duplicate", "shuffle", "insert", "drop_close", "stale_run", "edit_action",
          "edit_identity", "flip", "copy", "symlink", "swap"]  # fmt: skip
damage = st.tuples(st.sampled_from(_KINDS), st.integers(0, 10**6))

# An action record's damage: not JSON, a wrong type, or another run, rank, world or schema.
_ACTION_EDITS = [
    lambda rec: orjson.dumps(rec).replace(b'"action":', b'"action"', 1),
    lambda rec: orjson.dumps({**rec, "action": ["x"]}),
    lambda rec: orjson.dumps({**rec, "bytes_moved": "1"}),
    lambda rec: orjson.dumps({**rec, "seq": str(rec["seq"])}),
    lambda rec: orjson.dumps({**rec, "run": "another-run"}),
    lambda rec: orjson.dumps({**rec, "rank": rec["rank"] + 1}),
    lambda rec: orjson.dumps({**rec, "world": rec["world"] + 1}),
    lambda rec: orjson.dumps({**rec, "v": 1}),
    lambda rec: orjson.dumps({**rec, "v": 999}),
    lambda rec: orjson.dumps({k: v for k, v in rec.items() if k != "rank"}),
]
_IDENTITY = ("rank", "world", "v", "run")
# The bytes of a record that a flipped bit must never leave unseen, even without an index: its JSON
# structure (outside strings) and the values of its identity fields.
_IDENTITY_VALUE = re.compile(rb'"(?:v|rank|world|run)":("[^"]*"|-?[0-9]+)')


def _hostile(n: int) -> bytes:
    line = _HOSTILE[n % len(_HOSTILE)]
    return line.replace(b"%s", RUN.encode()).replace(b"%d", str(n % 97).encode())


def _lines(root: Path, rank: int) -> list[bytes]:
    return [ln for ln in (root / f"rank-{rank}.jsonl").read_bytes().split(b"\n") if ln.strip()]


def _apply(root: Path, world: int, kind: str, n: int) -> None:
    rnd = random.Random(n)
    path = root / f"rank-{n % world}.jsonl"
    if not path.is_file():
        return  # an earlier damage left no file here, or a link to none (a loop): that damage stands
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
    elif kind == "edit_action":
        actions = [i for i, ln in enumerate(lines) if b'"event":"action_' in ln]
        if actions:
            i = rnd.choice(actions)
            try:
                rec = orjson.loads(lines[i])
            except orjson.JSONDecodeError:
                return  # an earlier edit already made this line no record: it stays that damage
            lines[i] = _ACTION_EDITS[n % len(_ACTION_EDITS)](rec)
    elif kind == "edit_identity" and lines:
        i = rnd.randrange(len(lines))
        try:
            rec = orjson.loads(lines[i])
        except orjson.JSONDecodeError:
            return
        if isinstance(rec, dict):
            field = _IDENTITY[n % len(_IDENTITY)]
            old = rec.get(field)
            rec[field] = old + 1 + n % 3 if old.__class__ is int else f"{old}-x"
            lines[i] = orjson.dumps(rec)
    elif kind == "flip" and lines:
        i = rnd.randrange(len(lines))
        spots = _flippable(lines[i])
        if spots:
            at = rnd.choice(spots)
            lines[i] = lines[i][:at] + bytes([lines[i][at] ^ (1 << rnd.randrange(8))]) + lines[i][at + 1 :]
    elif kind in ("copy", "symlink", "swap"):
        other = root / f"rank-{(n // world + 1 + n) % world}.jsonl"
        if other == path or not other.is_file() or (kind == "symlink" and other.is_symlink()):
            return  # no file to take, or a link to a link (two links to each other would be a loop, not a trace)
        if kind == "swap":
            a, b = path.read_bytes(), other.read_bytes()
            path.unlink()
            other.unlink()
            path.write_bytes(b)
            other.write_bytes(a)
        else:
            # Read first: ``other`` may be a symlink to this very file (an earlier damage).
            data = other.read_bytes() if kind == "copy" else None
            path.unlink()
            if data is not None:
                path.write_bytes(data)
            elif kind == "symlink":
                os.symlink(other.name, path)
        return
    path.write_bytes(b"\n".join(lines) + b"\n")


def _flippable(line: bytes) -> list[int]:
    """Offsets of a record's structural bytes (outside strings) and of its identity fields' values."""
    if b"\\" in line:
        return []  # an escaped quote would fool the count below; the writer escapes nothing in these records
    spots, inside = [], False
    for i, c in enumerate(line):
        if c == 0x22:
            inside = not inside
            spots.append(i)
        elif not inside and c in b"{}[]:,":
            spots.append(i)
    for m in _IDENTITY_VALUE.finditer(line):
        spots.extend(range(m.start(1), m.end(1)))
    return spots


UNPROVEN = "not provable without the index"


def _without_unproven(said: tuple[int, dict[str, Any] | None]) -> tuple[int, dict[str, Any] | None]:
    code, d = said
    return code, d if d is None else {**d, "notes": [n for n in d["notes"] if not n.startswith(UNPROVEN)]}


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
# Whole files: another rank's copy, a link to it, two files swapped; an identity edited, a bit flipped.
@example(world=2, cycles=1, fault=None, at=0, damages=[("copy", 0)])
@example(world=3, cycles=1, fault=None, at=0, damages=[("symlink", 1)])
@example(world=2, cycles=1, fault=None, at=0, damages=[("swap", 0)])
@example(world=2, cycles=1, fault=None, at=0, damages=[("symlink", 0), ("copy", 1)])  # a copy of a symlink to itself
@example(world=2, cycles=1, fault=None, at=0, damages=[("edit_identity", 2)])
@example(world=2, cycles=1, fault=None, at=0, damages=[("flip", 7)])
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
        # Another run's id in a record (an edit, a flipped bit): the directory then holds two runs, refused (exit 2).
        runs_edited = bool(kinds & {"edit_action", "edit_identity", "flip"})
        # Nothing lost, nothing added: every rank file holds exactly its records, maybe shuffled or repeated.
        intact = all(set(_lines(root, r)) == written[r] for r in range(world))
        code, d = _replay(capsys, root)
        assert code in (0, 2, 3)
        if code == 2:
            # Bad input only for mixed runs, or when no file holds one whole line (each cut inside its first).
            assert "stale_run" in kinds or runs_edited or all(b"\n" not in p.read_bytes().strip()
                                                              for p in root.glob("rank-*.jsonl"))  # fmt: skip
            if "stale_run" in kinds or runs_edited:
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
@example(world=2, fault=None, damages=[("edit_action", 0), ("edit_action", 0)])  # an edit of an edited line
@example(world=2, fault=None, damages=[("symlink", 0), ("symlink", 1)])  # the second would link back: skipped
def test_an_index_never_changes_what_replay_says(capsys, world, fault, damages):
    """Indexes written at close, then any damage: replay says exactly what it says from the lines alone."""
    from miles_fsm.replay.index import write_index

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
        # Read from its lines alone, a file's unseen edits are not provable, and the report says so; it says
        # nothing else the index would not.
        assert alone[1] is None or any(n.startswith(UNPROVEN) for n in alone[1]["notes"]), alone
        indexed, alone = _without_unproven(indexed), _without_unproven(alone)
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


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(world=st.integers(2, 3), rank=st.integers(0, 2), at=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_single_bit_flip_in_a_closed_trace_is_never_ok(capsys, world, rank, at, bit):
    """Any one bit of a closed trace flipped (a digit of a duration, a letter of a name): its index says the
    trace changed after close, so replay is never ok; without the index, a flip the lines cannot show (a digit
    for another) may read ok, which is why the writer leaves one."""
    from miles_fsm.replay.index import write_index

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        healthy(root, world=world, cycles=1)
        for r in range(world):
            write_index(root / f"rank-{r}.jsonl", r)
        assert _replay(capsys, root)[0] == 0
        path = root / f"rank-{rank % world}.jsonl"
        data = bytearray(path.read_bytes())
        i = int(at * len(data))
        data[i] ^= 1 << bit
        path.write_bytes(bytes(data))
        code, d = _replay(capsys, root)
        assert code in (2, 3), d
        if code == 3:
            assert any("closed it" in x["reason"] for x in d["trace_problems"]["damaged"]), d["trace_problems"]
