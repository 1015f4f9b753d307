"""Reading per-rank traces and diagnosing the run: why a job hung, diverged or corrupted.

The pipeline, one module a stage: ``files`` finds the rank files and reads
them in blocks; ``fold`` (with ``hot``, ``checks``, ``order``) folds each
rank's records into a ``model.RankTrace``, or ``index`` reads the fold its
writer left at close; ``runs`` keeps one run; ``evidence``, ``divergence``,
``stalls`` and ``problems`` find what went wrong, which ``diagnose`` judges;
``report`` renders it and ``perfetto`` exports the timeline; ``fr_align``
places Flight Recorder dumps in the lifecycle's steps; ``shapes`` types the
entries of a ``Diagnosis`` (what ``--json`` prints). Nothing here imports
torch.
"""

from miles_fsm.replay.diagnose import Diagnosis, Verdict, diagnose
from miles_fsm.replay.model import EpochRange, RankTrace, TraceDirError
from miles_fsm.replay.perfetto import export_perfetto
from miles_fsm.replay.read import read_ranks
from miles_fsm.replay.report import replay
from miles_fsm.replay.shapes import (
    Culprit,
    FirstDivergence,
    FlightRecorderReport,
    GuardFailure,
    IllegalMove,
    OutsideFailure,
    RankEntry,
    StepFailure,
    StoppedRank,
    Straggler,
    TraceProblems,
    VerificationFailure,
)

__all__ = [
    "Culprit",
    "Diagnosis",
    "EpochRange",
    "FirstDivergence",
    "FlightRecorderReport",
    "GuardFailure",
    "IllegalMove",
    "OutsideFailure",
    "RankEntry",
    "RankTrace",
    "StepFailure",
    "StoppedRank",
    "Straggler",
    "TraceDirError",
    "TraceProblems",
    "Verdict",
    "VerificationFailure",
    "diagnose",
    "export_perfetto",
    "read_ranks",
    "replay",
]
