"""``miles-fsm replay`` says ok only when every byte of the traces was accounted for.

Damage that parses (another rank's file under this rank's name, an action
record of another run, a record of schema v999, a trace changed after its
writer closed it) is never ok: it is listed under
``trace_problems.damaged`` and, with nothing else to blame, the verdict is
``incomplete`` (exit 3). Names that are not rank files are reported, never
silently read or ignored. Property tests over generated damage are in
``test_replay_properties.py``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import pytest
from test_replay import as_json, run_cli
from trace_writer import RUN, healthy

from miles_fsm.replay.index import write_index


def rewrite(path: Path, edit) -> None:
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join(edit(lines)) + b"\n")


def edit_first(path: Path, event: bytes, change) -> None:
    """Change the first record of ``event`` in ``path`` (``change(record dict) -> bytes``)."""
    lines = path.read_bytes().splitlines()
    i = next(i for i, ln in enumerate(lines) if b'"event":"%s"' % event in ln)
    lines[i] = change(orjson.loads(lines[i]))
    path.write_bytes(b"\n".join(lines) + b"\n")


def damaged_not_ok(capsys, root: Path, *needles: str, verdict: str = "incomplete") -> dict:
    """Exit 3, ``verdict`` (``incomplete``: the damage alone), the damage listed and in the report."""
    code, d = as_json(capsys, str(root))
    assert (code, d["verdict"]) == (3, verdict), d["headline"]
    reasons = " | ".join(x["reason"] for x in d["trace_problems"]["damaged"])
    for needle in needles:
        assert needle in reasons, reasons
    if verdict != "incomplete":  # another problem leads; the damage is said under it
        assert any("the traces are damaged" in n for n in d["notes"]), d["notes"]
    code, out, _ = run_cli(capsys, str(root))
    assert code == 3 and out.startswith(f"{verdict.upper()}:") and ": damaged: " in out
    return d


# ------------------------------------------------ whole files


@pytest.mark.parametrize("how", ["copy", "symlink", "hard link", "swap"])
def test_a_rank_file_holding_another_ranks_records_is_not_ok(tmp_path, capsys, how):
    """rank-1.jsonl holding rank 0's records (a copy, a link) or two files swapped: rank 1's own trace is missing."""
    healthy(tmp_path, world=3)
    one, zero = tmp_path / "rank-1.jsonl", tmp_path / "rank-0.jsonl"
    if how == "swap":
        tmp = tmp_path / "x"
        one.rename(tmp)
        zero.rename(one)
        tmp.rename(zero)
    else:
        one.unlink()
        {"copy": lambda: shutil.copy(zero, one), "symlink": lambda: one.symlink_to(zero.name),
         "hard link": lambda: os.link(zero, one)}[how]()  # fmt: skip
    d = damaged_not_ok(capsys, tmp_path, "of rank 0")
    assert "rank-1.jsonl" in d["headline"]
    files = {Path(x["file"]).name for x in d["trace_problems"]["damaged"]}
    assert files == ({"rank-0.jsonl", "rank-1.jsonl"} if how == "swap" else {"rank-1.jsonl"})


# ------------------------------------------------ action lines


_ACTION_DAMAGE = {
    "not JSON": lambda rec: orjson.dumps(rec).replace(b'"action":', b'"action"', 1),
    "action not a string": lambda rec: orjson.dumps({**rec, "action": 7}),
    "duration not a number": lambda rec: orjson.dumps({**rec, "duration_s": "fast"}),
    "another run": lambda rec: orjson.dumps({**rec, "run": "another-run"}),
    "another rank": lambda rec: orjson.dumps({**rec, "rank": 2}),
    "another world": lambda rec: orjson.dumps({**rec, "world": 5}),
    "schema v1": lambda rec: orjson.dumps({**rec, "v": 1}),
    "schema v999": lambda rec: orjson.dumps({**rec, "v": 999}),
    "no rank": lambda rec: orjson.dumps({k: v for k, v in rec.items() if k != "rank"}),
    "seq not a number": lambda rec: orjson.dumps({**rec, "seq": "12"}),
}


@pytest.mark.parametrize("event", [b"action_started", b"action_finished"])
@pytest.mark.parametrize("kind", list(_ACTION_DAMAGE))
def test_a_damaged_action_record_is_never_ok(tmp_path, capsys, kind, event):
    """An action record that is not JSON, has a wrong type, or another run, rank, world or schema: not ok."""
    healthy(tmp_path, world=2)
    edit_first(tmp_path / "rank-1.jsonl", event, _ACTION_DAMAGE[kind])
    if kind == "another run":
        # Two runs in one file: refused until --run picks one; the record it then lacks is a lost record.
        code, _, err = run_cli(capsys, str(tmp_path))
        assert code == 2 and "changes run midway" in err
        code, d = as_json(capsys, str(tmp_path), "--run", RUN)
    else:
        code, d = as_json(capsys, str(tmp_path))
    assert code == 3 and d["verdict"] != "ok", d["headline"]
    tp = d["trace_problems"]
    assert tp["bad_lines"] or tp["lost_records"] or tp["damaged"], tp


# ------------------------------------------------ identity fields


@pytest.mark.parametrize("event", [b"trace_opened", b"transition_started", b"guard_entered",
                                   b"transition_finished", b"trace_closed"])  # fmt: skip
@pytest.mark.parametrize("field,value,needle", [("rank", 0, "of rank 0"), ("world", 7, "world 7"),
                                                ("v", 1, "schema v1"), ("v", 999, "schema v999")])  # fmt: skip
def test_identity_fields_are_checked_on_every_record(tmp_path, capsys, event, field, value, needle):
    """rank, world and v of any one record other than the file's: damage, named with its line."""
    healthy(tmp_path, world=2)
    edit_first(tmp_path / "rank-1.jsonl", event, lambda rec: orjson.dumps({**rec, field: value}))
    d = damaged_not_ok(capsys, tmp_path, needle)
    assert any(x["line"] >= 1 and Path(x["file"]).name == "rank-1.jsonl" for x in d["trace_problems"]["damaged"])


def test_a_whole_trace_of_schema_v999_is_not_ok(tmp_path, capsys):
    healthy(tmp_path, world=2)
    for r in range(2):
        rewrite(tmp_path / f"rank-{r}.jsonl", lambda ls: [ln.replace(b'"v":2', b'"v":999') for ln in ls])
    damaged_not_ok(capsys, tmp_path, "schema v999")


# ------------------------------------------------ changed after close


@pytest.mark.parametrize("damage", ["flip a digit", "truncate", "append"])
def test_a_trace_changed_after_close_is_reported_as_damage(tmp_path, capsys, damage):
    """The index proves the trace changed after its writer closed it: not ok, and said so, even when the lines
    alone look healthy (a digit of a duration flipped)."""
    healthy(tmp_path, world=2)
    for r in range(2):
        write_index(tmp_path / f"rank-{r}.jsonl", r)
    trace = tmp_path / "rank-1.jsonl"
    data = trace.read_bytes()
    if damage == "flip a digit":
        i = data.index(b'"duration_s":0.01') + len(b'"duration_s":0.0')
        data = data[:i] + b"3" + data[i + 1 :]
    elif damage == "truncate":
        data = data[: data.index(b"\n", len(data) // 2) - 5]  # inside a line: the wall clocks vary its length
    else:
        data += data.splitlines(keepends=True)[-1]
    trace.write_bytes(data)
    # Cut inside sync, rank 1 looks crashed there; the note under the verdict says the trace is damaged.
    d = damaged_not_ok(capsys, tmp_path, "changed after its writer closed it",
                       verdict="crashed" if damage == "truncate" else "incomplete")
    [x] = [x for x in d["trace_problems"]["damaged"] if "closed it" in x["reason"]]
    assert Path(x["file"]).name == "rank-1.jsonl"


# ------------------------------------------------ bad names


def test_a_forged_rank_file_far_beyond_the_world_keeps_the_report_small(tmp_path, capsys):
    """rank-1048575.jsonl beside a 3-rank run: damage naming it, not a world of a million missing ranks."""
    healthy(tmp_path, world=3)
    shutil.copy(tmp_path / "rank-0.jsonl", tmp_path / "rank-1048575.jsonl")
    code, out, _ = run_cli(capsys, str(tmp_path), "--json")
    assert len(out) < 100_000
    d = orjson.loads(out)
    assert (code, d["verdict"], d["world"], d["missing_ranks"]) == (3, "incomplete", 3, [])
    reasons = " | ".join(x["reason"] for x in d["trace_problems"]["damaged"])
    assert "beyond the world of 3" in reasons and "rank-1048575.jsonl" in d["headline"]


@pytest.mark.parametrize("name", ["rank-01.jsonl", "rank-\u0662.jsonl", "rank-+1.jsonl", "rank-1.jsonl\n",
                                  "rank- 1.jsonl", "rank-\uff11.jsonl"])  # fmt: skip
def test_a_name_that_is_not_a_rank_file_name_is_reported_not_read(tmp_path, capsys, name):
    """Only rank-<ASCII digits, no leading zero>.jsonl is a rank file; any other rank-*.jsonl is named, not read."""
    healthy(tmp_path, world=3)
    shutil.copy(tmp_path / "rank-1.jsonl", tmp_path / name)
    (tmp_path / "rank-2.jsonl").rename(tmp_path / "gone")  # a look-alike of rank 2 must not stand in for it
    d = damaged_not_ok(capsys, tmp_path, "not a rank file name")
    assert d["missing_ranks"] == [2]
    assert any(Path(x["file"]).name == name for x in d["trace_problems"]["damaged"])


def test_a_directory_of_look_alike_names_only_is_bad_input(tmp_path, capsys):
    healthy(tmp_path, world=1)
    (tmp_path / "rank-0.jsonl").rename(tmp_path / "rank-00.jsonl")
    code, out, err = run_cli(capsys, str(tmp_path))
    assert code == 2 and out == "" and "rank-00.jsonl" in err and len(err.strip().splitlines()) == 1
