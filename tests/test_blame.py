"""Who is suspect when ranks disagree: evidence decides; without it, a tie or an undecided split, said plainly."""

from __future__ import annotations

from miles_fsm.blame import suspects
from miles_fsm.guard.disagreement import explain_divergence
from miles_fsm.plan import Collective, Intent, TensorSet, TensorSpec


def _intent(epoch: int, names: tuple[str, ...], trigger: str = "sync") -> Intent:
    specs = TensorSet(tuple(TensorSpec(n, (4,), "bfloat16") for n in names))
    return Intent(epoch=epoch, trigger=trigger, source="REMATERIALIZED", dest="SYNCED", strategy="rematerialize",
                  collectives=(Collective("all_gather", "dp", "bfloat16", 4 * len(names)),), tensors=specs)  # fmt: skip


def test_the_rank_that_changed_since_the_last_agreement_is_suspect_even_one_against_one():
    """1 vs 1: rank 0 dropped a tensor since both agreed at epoch 1, so rank 0 is named, not the lower rank."""
    before = _intent(1, ("a", "b"))
    err = explain_divergence([_intent(2, ("a",)), _intent(2, ("a", "b"))], previous=before)
    assert err.culprits == (0,) and err.how == "changed"
    assert "they changed it since every rank last agreed" in str(err)


def test_one_against_one_without_history_is_said_to_be_a_tie():
    """With no earlier agreement a 1 vs 1 divergence names both ranks and says plainly that it is a tie."""
    err = explain_divergence([_intent(1, ("a",)), _intent(1, ("a", "b"))])
    assert err.culprits == (0, 1) and err.how == "tie"
    assert "It is a tie" in str(err)


def test_two_against_one_without_history_is_undecided_and_every_differing_field_is_shown():
    """2 vs 1 without history: the sizes are no evidence (the two may share the fault), so every rank is
    suspect and the error says it is undecided; the message lists the tensor set and the plan, and each
    rank's own (epoch, trigger) when they differ."""
    odd = _intent(3, ("a",), trigger="offload")
    err = explain_divergence([_intent(2, ("a", "b")), _intent(2, ("a", "b")), odd])
    assert err.culprits == (0, 1, 2) and err.how == "undecided"
    assert "Undecided" in str(err) and "the only ranks" not in str(err)
    assert set(err.differences) >= {"epoch", "trigger", "tensor set", "collective plan"}
    assert "rank 2: epoch 3, offload" in str(err)


def test_the_one_healthy_rank_is_never_singled_out_by_being_alone():
    """Ranks 1 and 2 both drop a tensor at the first sync; rank 0, alone, is healthy: nobody is decided."""
    err = explain_divergence([_intent(1, ("a", "b")), _intent(1, ("a",)), _intent(1, ("a",))])
    found = suspects({"ab": [0], "a": [1, 2]})
    assert not found.decided and found.ranks == (0, 1, 2)
    assert (err.culprits, err.how) == ((0, 1, 2), "undecided")


def test_suspects_prefers_evidence_to_the_majority():
    """Two of three ranks changed since the last agreement: they are suspect, though they are the majority."""
    found = suspects({"new": [0, 1], "old": [2]}, previous="old")
    assert found.ranks == (0, 1) and found.how == "changed"
    assert suspects({"x": [0], "y": [1]}).tie


def test_ranks_that_fired_different_triggers_do_not_use_their_own_histories():
    """Rank 1 fired offload where rank 0 fired sync: each rank's last agreement is of another trigger, so none is
    evidence; every rank reaches the same verdict (here a plain tie), whatever history it passes."""
    sync, offload = _intent(2, ("a",), trigger="sync"), _intent(2, ("a",), trigger="offload")
    for previous in (_intent(1, ("a",), trigger="sync"), _intent(1, ("a",), trigger="offload"), None):
        err = explain_divergence([sync, offload], previous=previous)
        assert (err.culprits, err.how) == ((0, 1), "tie")
