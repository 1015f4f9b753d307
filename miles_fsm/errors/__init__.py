"""Every miles-fsm error, in one index; each is a ``MilesFsmError``.

Each class keeps its facts as attributes named like its ``__init__``
keywords and builds its message from them, so a log line, a traceback and
``miles-fsm replay`` all say the same thing. ``fields()`` is the one way to
read those facts: traces record it and replay reads it back, never the
message text. Errors pickle as they are (message, fields, notes), so they
cross process boundaries (multiprocessing, Ray) as themselves; ``crossable``
turns an exception that would not into a ``RankRaisedError`` stand-in. Each
subclasses the stdlib error that fits, so callers that do not know miles-fsm
still catch them.

The engine's errors are defined in this package and imported from here:

- ``base``: ``MilesFsmError``, and ``describe``/``plain`` (what traces record);
- ``machine``: ``DefinitionError``, ``TransitionNotAllowed``, ``TransitionCancelled``,
  ``ConfigError``, ``MemoryReleasedError``, ``ProcessGroupMissingError``, ``RankFailedError``;
- ``guard``: ``GuardError`` and its ``RankDivergenceError``, ``GuardTimeoutError``,
  ``PeerLostError``, ``PeerFailedError``, ``PeerNeverJoinedError``, ``PeerStepFailedError``
  (with ``LastSeen``, what they report of a rank);
- ``crossing``: ``RankRaisedError``, the stand-in for an error that does not survive a pickle round
  trip (it does not pickle, or cannot be unpickled).

The layers above the engine keep their errors with them (this package
imports none of them: the engine never imports a layer above it):

- the lifecycle's, in ``miles_fsm.states.errors``: ``VerificationError``,
  ``TensorSetChangedError``, ``MemoryTagError``, ``WeightVersionError``,
  ``RecoveryError``, ``StructureVersionError``, ``DriverProtocolError``,
  ``UndeclaredCollectiveError``, ``MemoryDriftError``;
- the drivers', in ``miles_fsm.drivers.errors``: ``IneligibleModelError``,
  ``UnsupportedVersionError``, ``CudaAvailableError``, ``EngineRequestError``,
  ``EngineSessionError``, ``EngineUpdateError``, ``HostCopyMissingError``,
  ``BufferRoutingError``, ``ResumeMemoryError``, ``MissingDependencyError``,
  ``WeightChecksumError``, ``NotLlamaShapedError``, ``WeightLayoutError``;
- the launchers', in ``miles_fsm.launch.stopping`` (also importable from
  ``miles_fsm.launch`` and ``miles_fsm.launch.local``): ``LauncherLostError``,
  ``RankStoppedError``, ``RankSignalledError`` (and ``LaunchInterrupted``, a ``KeyboardInterrupt`` on
  purpose: no ``except Exception`` may swallow a Ctrl-C);
- replay's: ``TraceDirError`` in ``miles_fsm.replay.model``, ``MixedRunsError``
  in ``miles_fsm.replay.runs``, ``OutputPathError`` in ``miles_fsm.replay.outputs``
  (re-exported by ``miles_fsm.replay.perfetto``); ``FlightRecorderError`` in
  ``miles_fsm.flight_recorder``, its ``UnsafeDumpError`` (a torch-format dump that
  would run code) in ``miles_fsm.replay.fr_native`` and its ``DumpBudgetError`` (a dump
  larger, deeper or longer than any dump) in ``miles_fsm.replay.fr_budget``;
- the apps', in ``miles_fsm.apps.errors``: ``FaultLocatedError``, ``TraceDirUnusableError``.
"""

from miles_fsm.errors.base import (
    MilesFsmError,
    describe,
    list_names,
    list_ranks,
    message_of,
    plain,
    transport_failure,
)
from miles_fsm.errors.crossing import RankRaisedError, crossable, crosses
from miles_fsm.errors.guard import (
    GuardError,
    GuardTimeoutError,
    LastSeen,
    PeerFailedError,
    PeerLostError,
    PeerNeverJoinedError,
    PeerStepFailedError,
    RankDivergenceError,
)
from miles_fsm.errors.machine import (
    ConfigError,
    DefinitionError,
    MemoryReleasedError,
    ProcessGroupMissingError,
    RankFailedError,
    TransitionCancelled,
    TransitionNotAllowed,
)

__all__ = [
    "ConfigError",
    "DefinitionError",
    "GuardError",
    "GuardTimeoutError",
    "LastSeen",
    "MemoryReleasedError",
    "MilesFsmError",
    "PeerFailedError",
    "PeerLostError",
    "PeerNeverJoinedError",
    "PeerStepFailedError",
    "ProcessGroupMissingError",
    "RankDivergenceError",
    "RankFailedError",
    "RankRaisedError",
    "TransitionCancelled",
    "TransitionNotAllowed",
    "crossable",
    "crosses",
    "describe",
    "list_names",
    "list_ranks",
    "message_of",
    "plain",
    "transport_failure",
]
