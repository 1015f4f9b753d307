"""The public API an embedder reads in one screen: small facades whose ``__all__`` is a literal list,
one index of every error, and driver protocols that require exactly what the lifecycle calls."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import miles_fsm
from miles_fsm.errors import MilesFsmError

ROOT = Path(__file__).parents[1]

#: Each lazy facade, the file that declares its ``__all__``, and the map its names resolve through.
FACADES = {
    "miles_fsm": ROOT / "miles_fsm" / "__init__.py",
    "miles_fsm.states": ROOT / "states" / "__init__.py",
    "miles_fsm.drivers": ROOT / "drivers" / "__init__.py",
    "miles_fsm.errors": ROOT / "miles_fsm" / "errors" / "__init__.py",
}

#: Names the top-level facade used to export: each stays importable from the module that defines it.
LEFT_THE_FACADE = {
    "AsyncMachine": "miles_fsm.aio.machine", "StateChanges": "miles_fsm.aio.machine",
    "CYCLE": "miles_fsm.states", "DEFINITION": "miles_fsm.states", "Side": "miles_fsm.states",
    "Step": "miles_fsm.states", "StepKind": "miles_fsm.states", "Definition": "miles_fsm.definition",
    "Transition": "miles_fsm.definition", "Collective": "miles_fsm.plan", "Intent": "miles_fsm.plan",
    "TensorSet": "miles_fsm.plan", "TensorSpec": "miles_fsm.plan", "DIGEST_SCHEME": "miles_fsm.digest",
    "digest_tensors": "miles_fsm.digest", "Failure": "miles_fsm.machine", "InFlight": "miles_fsm.machine",
    "Machine": "miles_fsm.machine", "Plan": "miles_fsm.machine", "PlannedStep": "miles_fsm.machine",
    "StepResult": "miles_fsm.machine", "TransitionResult": "miles_fsm.machine",
    "MemoryLedger": "miles_fsm.states.memory", "FaultLocatedError": "miles_fsm.apps.errors",
    "FlightRecorderError": "miles_fsm.flight_recorder", "LastSeen": "miles_fsm.errors",
    "DefinitionError": "miles_fsm.errors", "GuardTimeoutError": "miles_fsm.errors",
    "MemoryReleasedError": "miles_fsm.errors", "PeerFailedError": "miles_fsm.errors",
    "PeerLostError": "miles_fsm.errors", "PeerNeverJoinedError": "miles_fsm.errors",
    "PeerStepFailedError": "miles_fsm.errors", "ProcessGroupMissingError": "miles_fsm.errors",
    "RankDivergenceError": "miles_fsm.errors", "RankRaisedError": "miles_fsm.errors",
    "TransitionCancelled": "miles_fsm.errors", "MemoryTagError": "miles_fsm.states.errors",
    "StructureVersionError": "miles_fsm.states.errors", "TensorSetChangedError": "miles_fsm.states.errors",
    "UndeclaredCollectiveError": "miles_fsm.states.errors", "WeightVersionError": "miles_fsm.states.errors",
    "BufferRoutingError": "miles_fsm.drivers.errors", "CudaAvailableError": "miles_fsm.drivers.errors",
    "EngineRequestError": "miles_fsm.drivers.errors", "EngineSessionError": "miles_fsm.drivers.errors",
    "EngineUpdateError": "miles_fsm.drivers.errors", "HostCopyMissingError": "miles_fsm.drivers.errors",
    "IneligibleModelError": "miles_fsm.drivers.errors", "MissingDependencyError": "miles_fsm.drivers.errors",
    "ResumeMemoryError": "miles_fsm.drivers.errors", "UnsupportedVersionError": "miles_fsm.drivers.errors",
    "WeightChecksumError": "miles_fsm.drivers.errors",
}  # fmt: skip

#: What ``miles_fsm.errors`` exported when it was one module: every name must still import from it.
ERRORS_NAMES = [
    "ConfigError", "DefinitionError", "GuardError", "GuardTimeoutError", "LastSeen", "MemoryReleasedError",
    "MilesFsmError", "PeerFailedError", "PeerLostError", "PeerNeverJoinedError", "PeerStepFailedError",
    "ProcessGroupMissingError", "RankDivergenceError", "RankFailedError", "RankRaisedError", "TransitionCancelled",
    "TransitionNotAllowed", "crossable", "describe", "list_names", "list_ranks", "plain", "crosses", "message_of",
    "transport_failure",
]  # fmt: skip

#: Modules outside ``miles_fsm.errors`` that define errors; the index names each of their classes.
OTHER_ERROR_MODULES = ("miles_fsm.states.errors", "miles_fsm.drivers.errors", "miles_fsm.apps.errors",
                       "miles_fsm.launch.stopping", "miles_fsm.flight_recorder", "miles_fsm.replay.model",
                       "miles_fsm.replay.runs", "miles_fsm.replay.outputs", "miles_fsm.replay.fr_budget")  # fmt: skip


def _literal_all(path: Path) -> list[str]:
    """The ``__all__`` a type checker reads: a literal list of strings, or the test fails."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            assert isinstance(node.value, ast.List), f"{path}: __all__ is computed, not a literal list"
            assert all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.value.elts), path
            return [e.value for e in node.value.elts]
    raise AssertionError(f"{path} declares no __all__")


def test_the_top_level_facade_fits_one_screen():
    """At most 35 names, and none of them the engine's internals or the demo's errors."""
    assert len(miles_fsm.__all__) <= 35, len(miles_fsm.__all__)
    internals = {"Machine", "Plan", "InFlight", "MemoryLedger", "FaultLocatedError", "PlannedStep", "Failure"}
    assert not internals & set(miles_fsm.__all__)


def test_what_an_embedder_needs_is_on_the_facade():
    """The lifecycle and its configs, the table's enums, the driver protocols, the reference drivers, the async
    lifecycle, the launchers' entry points, and the errors a caller catches at the top."""
    needed = {"Lifecycle", "LifecycleConfig", "GuardConfig", "VerifyConfig", "State", "Trigger", "Strategy",
              "TrainerDriver", "EngineDriver", "ReferenceTrainer", "ReferenceEngine", "AsyncLifecycle",
              "run_ranks", "run_ranks_ray", "run_under_torchrun", "RankOutcome", "MilesFsmError", "ConfigError",
              "TransitionNotAllowed", "GuardError", "DriverProtocolError"}  # fmt: skip
    assert needed <= set(miles_fsm.__all__)
    for name in miles_fsm.__all__:
        assert getattr(miles_fsm, name) is not None, name


@pytest.mark.parametrize("name", sorted(LEFT_THE_FACADE))
def test_a_name_that_left_the_facade_imports_from_its_module(name):
    """Nothing was deleted: only the facade shrank."""
    assert name not in miles_fsm.__all__
    assert getattr(importlib.import_module(LEFT_THE_FACADE[name]), name) is not None


@pytest.mark.parametrize("package", sorted(FACADES))
def test_each_facade_declares_a_literal_all_that_is_what_it_resolves(package):
    """``__all__`` is a literal list (type checkers and doc tools read it), equal to the names the lazy map (and
    the eager imports) resolve, so the two cannot drift."""
    mod = importlib.import_module(package)
    declared = _literal_all(FACADES[package])
    assert declared == mod.__all__
    assert len(set(declared)) == len(declared)
    lazy = getattr(mod, "_EXPORTS", None) or getattr(mod, "_LAZY", None) or {}
    eager = {"miles_fsm": {"__version__"},
             "miles_fsm.states": set(importlib.import_module("miles_fsm.states.definition").__all__)}.get(package, set())
    if lazy:
        assert set(declared) == set(lazy) | eager
    for name in declared:
        assert hasattr(mod, name), f"{package}.{name}"


def test_the_errors_index_keeps_every_name_it_had():
    import miles_fsm.errors as errors

    for name in ERRORS_NAMES:
        assert getattr(errors, name) is not None, name
        assert name in errors.__all__, name


def _error_classes(module: str) -> list[type[BaseException]]:
    mod = importlib.import_module(module)
    return [c for _, c in inspect.getmembers(mod, inspect.isclass)
            if issubclass(c, Exception) and c.__module__ == mod.__name__]  # fmt: skip


def test_every_error_of_the_engine_is_in_the_index_and_a_miles_fsm_error():
    """``miles_fsm.errors`` re-exports every error class defined in its package, each a MilesFsmError."""
    import miles_fsm.errors as errors

    package = Path(errors.__file__).parent
    modules = [f"miles_fsm.errors.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"]
    classes = [c for m in modules for c in _error_classes(m)]
    assert classes
    for cls in classes:
        assert issubclass(cls, MilesFsmError), cls
        assert getattr(errors, cls.__name__) is cls and cls.__name__ in errors.__all__, cls


@pytest.mark.parametrize("module", OTHER_ERROR_MODULES)
def test_the_index_says_where_every_other_layers_error_lives(module):
    """Every error class miles-fsm defines is a MilesFsmError, and the index's docstring names it and its module."""
    import miles_fsm.errors as errors

    classes = _error_classes(module)
    assert classes, module
    for cls in classes:
        assert issubclass(cls, MilesFsmError), cls
        assert cls.__name__ in errors.__doc__, cls
    assert module in errors.__doc__


def test_the_replay_errors_keep_their_stdlib_base_and_facts():
    """TraceDirError, MixedRunsError and OutputPathError are MilesFsmErrors that callers still catch as ValueError,
    with their facts as fields."""
    from miles_fsm.replay.model import TraceDirError
    from miles_fsm.replay.perfetto import OutputPathError
    from miles_fsm.replay.runs import MixedRunsError

    for exc in (TraceDirError("t", "empty"), MixedRunsError("t", {"a": ["rank-0.jsonl"]}, []),
                OutputPathError("o.json", "is a directory")):  # fmt: skip
        assert isinstance(exc, MilesFsmError) and isinstance(exc, ValueError)
    assert MixedRunsError("t", {"a": ["rank-0.jsonl"]}, ["rank 1"]).fields() == {
        "path": "t", "files": {"a": ["rank-0.jsonl"]}, "changing": ["rank 1"]}  # fmt: skip


def test_no_errors_module_is_over_400_lines():
    import miles_fsm.errors as errors

    for path in Path(errors.__file__).parent.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path


def test_the_trainer_protocol_requires_only_what_the_lifecycle_calls():
    """A trainer without ``copy`` and ``get`` (the lifecycle never calls them) is accepted and runs full cycles."""
    from miles_fsm import Lifecycle, State, TrainerDriver
    from toy import ToyEngine, ToyTrainer

    assert not {"copy", "get"} & set(dir(TrainerDriver))
    lean = type("LeanTrainer", (), {k: v for k, v in vars(ToyTrainer).items() if k not in ("copy", "get")})
    lc = Lifecycle(trainer=lean(), engine=ToyEngine())
    lc.start()
    for _ in range(2):
        for t in ("offload", "pause", "rematerialize", "sync", "resume"):
            lc.fire(t)
    assert lc.state is State.TRAINING and lc.epoch == 2
