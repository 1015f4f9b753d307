"""Launchers: run a rank function on N ranks and always clean up.

``local`` starts gloo ranks from a forkserver (the demo's and the tests'
launcher); ``ray_actors`` runs them as Ray actors; ``torchrun`` runs one
rank under torchrun or any launcher that sets ``RANK`` and ``WORLD_SIZE``.
"""

from miles_fsm.launch.local import (
    LauncherLostError,
    LaunchInterrupted,
    RankContext,
    RankError,
    RankOutcome,
    RankSignalledError,
    RankStoppedError,
    StopReason,
    run_ranks,
)
from miles_fsm.launch.ray_actors import RayOutcome, run_ranks_ray
from miles_fsm.launch.torchrun import run_under_torchrun

__all__ = [
    "LaunchInterrupted",
    "LauncherLostError",
    "RankContext",
    "RankError",
    "RankOutcome",
    "RankSignalledError",
    "RankStoppedError",
    "RayOutcome",
    "StopReason",
    "run_ranks",
    "run_ranks_ray",
    "run_under_torchrun",
]
