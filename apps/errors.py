"""The demo's own failure: a rank that stopped, with the evidence of which rank caused it."""

from __future__ import annotations

from collections.abc import Sequence

from miles_fsm.errors import MilesFsmError, list_ranks

__all__ = ["FaultLocatedError"]


class FaultLocatedError(MilesFsmError, RuntimeError):
    """This rank failed because of another rank (or itself), and the evidence says which."""

    def __init__(self, *, rank: int, culprits: Sequence[int], evidence: str, cause: str) -> None:
        self.rank = rank
        self.culprits = tuple(sorted(culprits))
        self.evidence = evidence
        self.cause = cause
        super().__init__(
            f"rank {rank} stopped; culprit rank(s) {list_ranks(self.culprits)}: {evidence}. "
            f"Error seen here: {cause}. Read the culprit's trace with `miles-fsm replay`."
        )
