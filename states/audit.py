"""The plan audit: what a step really issued, from the Flight Recorder, against what its plan declared.

The guard trusts each step's declared collectives; a step that issues one
more makes the ranks hang in it while every guard passed. The audit reads
the recorder's entries made between each step's start and end and raises
``UndeclaredCollectiveError`` on the rank that issued the extra one, in the
transition's last step, so the transition fails (and the peers learn it at
their next guard) before the next transition starts.

Plans name groups logically ("dp", "chunk0.dp.bg0"), the recorder by
process-group id, so entries are matched by op alone, preferring the same
size; the guard's own group is skipped (its collectives are the audit's
business only when they are not the guard's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_fsm import flight_recorder as fr
from miles_fsm.states.errors import UndeclaredCollectiveError

if TYPE_CHECKING:
    from miles_fsm.config import VerifyConfig
    from miles_fsm.guard.consensus import Guard
    from miles_fsm.plan import Collective

__all__ = ["PlanAudit", "dump_beside_trace", "make_audit", "undeclared"]

#: What a declared op may show up as in the recorder: gloo runs reduce_scatter as an all_reduce.
_ALIASES = {
    "all_gather": {"all_gather", "_allgather_base", "all_gather_into_tensor"},
    "reduce_scatter": {"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor", "all_reduce"},
}


def undeclared(issued: Sequence[fr.FrEntry], declared: Iterable[Collective]) -> list[fr.FrEntry]:
    """The issued entries no declared collective accounts for (each declared one accounts for one)."""
    left = list(issued)
    for c in declared:
        ops = _ALIASES.get(c.op, {c.op})
        fits = [e for e in left if e.op in ops]
        if fits:
            left.remove(next((e for e in fits if e.size == c.numel), fits[0]))
    return left


class PlanAudit:
    """Wraps one rank's step actions; ``active(epoch)`` says which cycles it checks.

    Reading the recorder costs a copy of its whole buffer, so it is read
    once per audited transition, after its last step: each step's entries
    are told apart by their creation time (wall clock, as the recorder
    stamps them) against the step's own start and end.
    """

    def __init__(self, *, rank: int, active: Callable[[int], bool], skip_pgs: Iterable[str] = ()) -> None:
        self._rank = rank
        self._active = active
        self._skip = frozenset(skip_pgs)
        self._ran: list[tuple[str, Any, Sequence[Collective], int, int]] = []

    def wrap(
        self,
        action: Callable[[Any, int], Any],
        declared: Callable[[Any], Sequence[Collective]],
        *,
        trigger: str,
        name: str,
        first: bool,
        last: bool,
    ) -> Callable[[Any, int], Any]:
        """``action``, audited on the cycles ``active`` names; ``first``/``last``: its place in the transition."""

        def audited(step: Any, epoch: int) -> Any:
            if not self._active(epoch):
                return action(step, epoch)
            if first:
                self._ran = []  # a transition that failed in a step left its earlier steps here
            t0 = time.time_ns()
            report = action(step, epoch)
            self._ran.append((name, step, declared(step), t0, time.time_ns()))
            if last:
                self.check_transition(epoch=epoch, trigger=trigger)
            return report

        return audited

    def check_transition(self, *, epoch: int, trigger: str) -> None:
        """Check every step of the transition just run against one read of the recorder."""
        ran, self._ran = self._ran, []
        if not ran:
            return
        issued = [e for e in fr.entries(since_ns=ran[0][3]) if e.pg not in self._skip]
        for name, _step, declared, t0, t1 in ran:
            self.check([e for e in issued if t0 <= e.time_ns <= t1], declared, epoch=epoch, trigger=trigger,
                       step=name)  # fmt: skip

    def check(self, issued: Sequence[fr.FrEntry], declared: Sequence[Collective], *, epoch: int, trigger: str,
              step: str) -> None:  # fmt: skip
        """Raise ``UndeclaredCollectiveError`` for the first issued collective the plan lacks."""
        mine = [e for e in issued if e.pg not in self._skip]
        extra = undeclared(mine, declared)
        if extra:
            raise UndeclaredCollectiveError(rank=self._rank, epoch=epoch, trigger=trigger, step=step,
                                            collective=str(extra[0]), declared=[str(c) for c in declared])  # fmt: skip


def guard_pg(guard: Guard) -> str | None:
    """The name of the guard's own process group, as the recorder names it (None: no group)."""
    # The guard's collectives are no step's, so the audit must know its group.
    group = guard.group
    return str(group.group_name) if group is not None and hasattr(group, "group_name") else None


def make_audit(verify: VerifyConfig, guard: Guard) -> PlanAudit | None:
    """The audit a lifecycle runs, or None when it is off or the recorder is (nothing to read, no cost)."""
    if not (verify.audit and fr.enabled()):
        return None
    pg = guard_pg(guard)
    return PlanAudit(rank=guard.rank, active=verify.audits, skip_pgs=[pg] if pg else [])


def dump_beside_trace(trace_dir: Path | None, guard: Guard, **meta: Any) -> Path | None:
    """This rank's recorder as ``trace_dir/fr-rank-<r>.json``, with the guard's group named for replay."""
    if trace_dir is None or not fr.enabled():
        return None
    return fr.dump(trace_dir, guard.rank, guard_pg=guard_pg(guard), **meta)
