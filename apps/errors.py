"""The demo's own failures: a rank that stopped (with the evidence of who caused it); an unusable trace directory."""

from __future__ import annotations

from collections.abc import Sequence

from miles_fsm.errors import MilesFsmError, list_ranks

__all__ = ["FaultLocatedError", "TraceDirUnusableError"]


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


class TraceDirUnusableError(MilesFsmError, OSError):
    """The demo's ``--trace-dir`` cannot be created, written or cleared of earlier traces."""

    def __init__(self, *, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"--trace-dir {path}: cannot use it ({reason}); give a directory you can write, "
            "or leave --trace-dir out for ./miles-fsm-traces/<timestamp>"
        )
