"""The fold's msgspec path for transition and guard records reads every line exactly as orjson alone does."""

from __future__ import annotations

import orjson
import pytest
from miles_fsm.replay import fold as trace_fold
from miles_fsm.replay.files import blocks
from miles_fsm.replay.model import RankTrace
from trace_writer import RankWriter


def _fold(path, *, orjson_only: bool, monkeypatch) -> str:
    if orjson_only:
        def refuse(line):
            raise trace_fold.hot_errors[0]("orjson only")

        monkeypatch.setattr(trace_fold, "decode_hot", refuse)
    t = RankTrace(rank=0, path=str(path))
    ok = trace_fold.fold(t, blocks(path), path, None, None)
    monkeypatch.undo()
    # repr, not ==: the per-position arrays hold NaN for durations not recorded.
    return f"{ok} {t!r}"


def _rewrite(lines: list[bytes], event: str, change) -> list[bytes]:
    out = []
    for line in lines:
        rec = orjson.loads(line)
        if rec["event"] == event:
            line = change(rec, line)
        out.append(line)
    return out


_CHANGES = {
    "as written": ("transition_started", lambda rec, line: line),
    "host context keys": ("guard_entered", lambda rec, line: line[:-1] + b',"job":"ppo-7","rl_step":3}'),
    "integer duration": ("transition_finished", lambda rec, line: orjson.dumps({**rec, "duration_s": 1})),
    "null state": ("transition_finished", lambda rec, line: orjson.dumps({**rec, "state": None})),
    "u64 key": ("guard_entered", lambda rec, line: orjson.dumps({**rec, "key": 2**64 - 1})),
    "int64 edge key": ("guard_entered", lambda rec, line: orjson.dumps({**rec, "key": -(2**63)})),
    "beyond u64": ("guard_entered", lambda rec, line: line.replace(b'"key":', b'"key":1234567890123456789012345,"k":')),
    "ints as steps": ("transition_started", lambda rec, line: orjson.dumps({**rec, "steps": [1, 2]})),
    "float seq": ("guard_passed", lambda rec, line: line.replace(b'"seq":', b'"seq":1.5,"s":')),
    "bool epoch": ("transition_started", lambda rec, line: orjson.dumps({**rec, "epoch": True})),
    "duplicate key": ("transition_started", lambda rec, line: line[:-1] + b',"trigger":"sync"}'),
    "escaped names": ("transition_started", lambda rec, line: line.replace(b'"state":"', b'"state":"\\u00e9')),
    "lone surrogate": ("guard_passed", lambda rec, line: line[:-1] + b',"x":"\\ud800"}'),
    "wrong arrow": ("transition_finished", lambda rec, line: orjson.dumps({**rec, "state": "WAKING"})),
}


@pytest.mark.parametrize("name", list(_CHANGES))
def test_the_msgspec_path_folds_a_rank_exactly_as_orjson_alone(tmp_path, monkeypatch, name):
    """Whatever a transition, guard or verify record holds (extra keys, integers where floats go, values
    beyond 64 bits, wrong types, duplicate keys, escapes), the fold gives the same result field for field
    with msgspec as with every line read by orjson."""
    w = RankWriter(0, 2)
    w.cycles(2)
    path = w.write(tmp_path)
    event, change = _CHANGES[name]
    path.write_bytes(b"\n".join(_rewrite(path.read_bytes().splitlines(), event, change)) + b"\n")
    assert _fold(path, orjson_only=False, monkeypatch=monkeypatch) == _fold(path, orjson_only=True,
                                                                           monkeypatch=monkeypatch)
