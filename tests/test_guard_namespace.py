"""The guard's store keys follow from the group it guards, not from how many guards a process built."""

from __future__ import annotations

import pytest

import ranks_guard
from miles_fsm.guard.store import group_namespace
from miles_fsm.launch.local import run_ranks


def test_a_namespace_is_numbered_among_guards_over_the_same_ranks_and_name_only():
    """What a rank built over other groups, or under other names, does not move a group's namespaces; a
    second guard over the same ranks and name gets a namespace of its own."""
    group, name = (901, 902, 903), "actor"
    first = group_namespace("guard", group, name)
    group_namespace("guard", (901, 902), name)  # a subgroup, built on some ranks only
    group_namespace("guard", group, "ref")  # another lifecycle over the same ranks
    group_namespace("roll", group, name)  # the roll call before a guard
    second = group_namespace("guard", group, name)
    assert first != second
    assert first.removesuffix("0/") == second.removesuffix("1/")  # the same group's, numbered 0 and 1
    assert group_namespace("guard", (901, 902, 904), name) != first  # other ranks: another namespace


@pytest.mark.slow
def test_a_guard_over_a_subgroup_on_some_ranks_leaves_the_default_groups_guard_in_agreement(assert_no_leftovers):
    """Ranks 0 and 1 build one more guard (over a subgroup rank 2 is not in) than rank 2 does: the guard they
    then all build over the default group still shares one namespace and one run id, and passes."""
    out = run_ranks(ranks_guard.extra_guard_on_a_subgroup, 3, timeout_s=30)
    assert all(o.ok for o in out), [o.error for o in out]
    assert len({o.result["namespace"] for o in out}) == 1
    assert len({o.result["run"] for o in out}) == 1
