"""The guard's store keys follow from the group it guards, not from how many guards a process built."""

from __future__ import annotations

import pytest

import ranks_guard
from miles_fsm.launch.local import run_ranks

pytestmark = pytest.mark.slow


def test_a_guard_over_a_subgroup_on_some_ranks_leaves_the_default_groups_guard_in_agreement(assert_no_leftovers):
    """Ranks 0 and 1 build one more guard (over a subgroup rank 2 is not in) than rank 2 does: the guard they
    then all build over the default group still shares one namespace and one run id, and passes."""
    out = run_ranks(ranks_guard.extra_guard_on_a_subgroup, 3, timeout_s=30)
    assert all(o.ok for o in out), [o.error for o in out]
    assert len({o.result["namespace"] for o in out}) == 1
    assert len({o.result["run"] for o in out}) == 1
