"""The shapes of what the Flight Recorder dumps say in ``Diagnosis.flight_recorder`` (and ``--json``).

Apart from ``shapes`` so that each module stays small; ``miles_fsm.replay.shapes`` lists them too.
"""

from __future__ import annotations

from typing import Literal, TypedDict

__all__ = ["CollectiveEntry", "FlightRecorderReport", "FrGroup", "FrPart"]


class CollectiveEntry(TypedDict):
    """A rank's last collective in its Flight Recorder dump, placed in the step that issued it."""

    rank: int
    op: str
    collective_seq_id: int
    process_group: str
    input_sizes: list[list[int]]
    output_sizes: list[list[int]]
    time_ns: int
    where: str
    epoch: int | None
    declared: bool | None


class FrPart(TypedDict):
    """Ranks of one group that sit in the same collective (``FrGroup.parts``)."""

    ranks: list[int]
    op: str
    collective_seq_id: int
    input_sizes: list[list[int]]


class FrGroup(TypedDict):
    """One process group of torch-format dumps, as torch's own analyzer aligns it (``None`` kind: matched)."""

    name: str
    desc: str
    members: list[int]
    line: str
    kind: str | None
    op: str | None
    collective_seq_id: int | None
    culprits: list[int]
    missing: list[int]
    detail: str
    later: int  # unmatched collectives of the group after the first
    idle: list[int]
    parts: list[FrPart]


class _FlightRecorderReport(TypedDict):
    line: str
    mismatch: bool
    ranks: list[CollectiveEntry]
    missing: list[int]
    problems: list[str]
    #: torch's per-group alignment; None: no torch-format dump was read.
    groups: list[FrGroup] | None


class FlightRecorderReport(_FlightRecorderReport, total=False):
    """What the Flight Recorder dumps say (``FrReport.to_json()``); ``format`` and ``prefix`` only for dumps
    read without lifecycle traces."""

    format: Literal["torch"]
    prefix: str
