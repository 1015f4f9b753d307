"""Whom replay suspects when ranks diverge: the live guard's rule (``miles_fsm.blame``), with its reason.

On a 1-vs-1 divergence the sizes of the groups tell nothing; the earlier
agreement on the same trigger does (the rank that changed), and when there
is none the report says plainly that it is a tie (or, sides of unequal size, undecided), lists every
suspect, and puts nobody in the ``culprit`` field: a guess is not a culprit.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from miles_fsm.apps.cli import main
from trace_writer import TENSORS, RankWriter

from miles_fsm.blame import suspects


def as_json(capsys, *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["replay", *argv, "--json"])
    return code, orjson.loads(capsys.readouterr().out)


def two_ranks(root, *, changer: int, first_sync: bool = False) -> None:
    """Two ranks; ``changer`` plans another tensor set at sync, at the first one or after one they agreed on."""
    for r in range(2):
        w = RankWriter(r, 2)
        if not first_sync:
            w.cycles(1)
        else:
            w.transition("start")
        w.transition("offload"), w.transition("pause"), w.transition("rematerialize")
        w.transition("sync", tensors="c" * 32 if r == changer else TENSORS)
        w.write(root)


@pytest.mark.parametrize("changer", [0, 1])
def test_one_against_one_blames_the_rank_that_changed_since_the_last_agreement(tmp_path, capsys, changer):
    """Sync of epoch 1 agreed; at epoch 2 one rank's tensor set differs: that rank, how 'changed', either way round."""
    two_ranks(tmp_path, changer=changer)
    code, d = as_json(capsys, str(tmp_path))
    f = d["first_divergence"]
    assert (code, d["verdict"], f["field"], f["epoch"]) == (3, "divergence", "tensors", 2)
    assert (f["culprits"], f["how"], f["tie"]) == ([changer], "changed", False)
    assert d["culprit"]["ranks"] == [changer]
    assert "changed it since the last time every rank agreed" in d["headline"]


def test_replay_names_the_suspects_the_live_guard_names(tmp_path, capsys):
    """Replay's suspects are blame.suspects of the same groups and the value agreed at the last sync."""
    two_ranks(tmp_path, changer=0)
    _, d = as_json(capsys, str(tmp_path))
    f = d["first_divergence"]
    groups = {repr(g["value"]): g["ranks"] for g in f["groups"]}
    live = suspects(groups, previous=repr(TENSORS))
    assert (f["culprits"], f["how"], f["reason"]) == (list(live.ranks), live.how, live.reason)


def test_a_tie_without_earlier_agreement_is_said_plainly_and_names_no_culprit(tmp_path, capsys):
    """At the first sync nothing tells 1 from 1: 'a tie', both ranks suspect, in the JSON and the text; the
    culprit field is undecided and names nobody."""
    two_ranks(tmp_path, changer=1, first_sync=True)
    code, d = as_json(capsys, str(tmp_path))
    f = d["first_divergence"]
    assert (code, f["how"], f["tie"], f["decided"], f["culprits"]) == (3, "tie", True, False, [0, 1])
    c = d["culprit"]
    assert (c["ranks"], c["decided"], c["suspects"]) == ([], False, [0, 1])
    assert "a tie" in d["headline"] and "0-1" in d["headline"]
    main(["replay", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("DIVERGENCE:") and "a tie: " in out
    assert "culprit: undecided (suspects: 0-1)" in out


def test_two_diverging_ranks_at_the_first_guard_do_not_make_the_healthy_rank_the_culprit(tmp_path, capsys):
    """Ranks 1 and 2 plan another tensor set at the first sync; rank 0 alone is right. Nothing earlier says
    which side changed: undecided, every rank a suspect, the culprit field names nobody."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.transition("start")
        w.transition("offload"), w.transition("pause"), w.transition("rematerialize")
        w.transition("sync", tensors="c" * 32 if r else TENSORS)
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    f = d["first_divergence"]
    assert (code, d["verdict"], f["how"], f["decided"], f["culprits"]) == (3, "divergence", "undecided", False,
                                                                           [0, 1, 2])
    assert (d["culprit"]["ranks"], d["culprit"]["suspects"]) == ([], [0, 1, 2])
    assert "undecided" in d["headline"] and "suspect rank 0:" not in d["headline"]


def test_every_differing_field_is_shown_with_its_groups(tmp_path, capsys):
    """A different tensor set and plan: tensors, collectives and the fingerprint are each grouped, in order."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.transition("offload"), w.transition("pause"), w.transition("rematerialize")
        w.transition("sync", tensors="d" * 32 if r == 2 else TENSORS, plan=["all_gather@dp[64:bfloat16]"] if r == 2
                     else None)  # fmt: skip
        w.write(tmp_path)
    _, d = as_json(capsys, str(tmp_path))
    f = d["first_divergence"]
    assert [x["field"] for x in f["differences"]] == ["tensors", "collectives", "plan fingerprint"]
    assert all([g["ranks"] for g in x["groups"]] == [[0, 1], [2]] for x in f["differences"])
    assert f["also_differ"] == ["collectives", "plan fingerprint"]
    main(["replay", str(tmp_path)])
    out = capsys.readouterr().out
    assert "    collectives:\n      ranks 0-1: all_gather@dp[192:bfloat16]\n      rank 2: all_gather@dp[64:bfloat16]" in out
