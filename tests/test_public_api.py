"""The public API an embedder reads in one screen: small facades whose ``__all__`` is a literal list,
one index of every error, and driver protocols that require exactly what the lifecycle calls."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
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

#: 0.1.0's top level (``git show ae91df5^:miles_fsm/__init__.py``): each name is on the facade today or in
#: docs/architecture.md's table of names that left it.
V010_TOP_LEVEL = [
    "AsyncLifecycle", "AsyncMachine", "AsyncSnapshot", "BufferRoutingError", "CYCLE", "Collective", "ConfigError",
    "CudaAvailableError", "DEFINITION", "DIGEST_SCHEME", "Definition", "DefinitionError", "DriverProtocolError",
    "EngineDriver", "EngineRequestError", "EngineSessionError", "EngineUpdateError", "Failure", "FaultLocatedError",
    "FlightRecorderError", "Guard", "GuardConfig", "GuardError", "GuardTimeoutError", "HostCopyMissingError",
    "InFlight", "IneligibleModelError", "Intent", "LastSeen", "LauncherLostError", "Lifecycle", "LifecycleConfig",
    "Machine", "MemoryLedger", "MemoryReleasedError", "MemoryTagError", "MilesFsmError", "MissingDependencyError",
    "PeerFailedError", "PeerLostError", "PeerNeverJoinedError", "PeerStepFailedError", "Plan", "PlannedStep",
    "ProcessGroupMissingError", "RankDivergenceError", "RankFailedError", "RankRaisedError", "RankStoppedError",
    "RecoveryError", "ResumeMemoryError", "RolloutWindow", "Side", "Snapshot", "State", "StateChange", "StateChanges",
    "Step", "StepKind", "StepReport", "StepResult", "Strategy", "StructureVersionError", "TensorSet",
    "TensorSetChangedError", "TensorSpec", "TrainerDriver", "Transition", "TransitionCancelled", "TransitionNotAllowed",
    "TransitionResult", "Trigger", "UndeclaredCollectiveError", "UnsupportedVersionError", "VerificationError",
    "VerifyConfig", "VersionedTrainer", "WeightChecksumError", "WeightVersionError", "digest_tensors",
]  # fmt: skip

#: Names of 0.1.0's top level that user code named (issue 37): back on the facade.
BACK_ON_THE_FACADE = ["Collective", "TensorSet", "StepKind", "MemoryReleasedError", "digest_tensors",
                      "IneligibleModelError", "LastSeen"]  # fmt: skip

#: Names the top-level facade used to export and no longer does: each imports from the module that defines it.
LEFT_THE_FACADE = {
    "AsyncMachine": "miles_fsm.aio.machine", "StateChanges": "miles_fsm.aio.machine",
    "CYCLE": "miles_fsm.states", "DEFINITION": "miles_fsm.states", "Side": "miles_fsm.states",
    "Definition": "miles_fsm.definition", "Transition": "miles_fsm.definition", "Intent": "miles_fsm.plan",
    "TensorSpec": "miles_fsm.plan", "DIGEST_SCHEME": "miles_fsm.digest",
    "Failure": "miles_fsm.machine", "InFlight": "miles_fsm.machine",
    "Machine": "miles_fsm.machine", "Plan": "miles_fsm.machine", "PlannedStep": "miles_fsm.machine",
    "StepResult": "miles_fsm.machine", "TransitionResult": "miles_fsm.machine",
    "MemoryLedger": "miles_fsm.states.memory", "FaultLocatedError": "miles_fsm.apps.errors",
    "FlightRecorderError": "miles_fsm.flight_recorder",
    "DefinitionError": "miles_fsm.errors", "GuardTimeoutError": "miles_fsm.errors",
    "PeerFailedError": "miles_fsm.errors",
    "PeerLostError": "miles_fsm.errors", "PeerNeverJoinedError": "miles_fsm.errors",
    "PeerStepFailedError": "miles_fsm.errors", "ProcessGroupMissingError": "miles_fsm.errors",
    "RankDivergenceError": "miles_fsm.errors", "RankRaisedError": "miles_fsm.errors",
    "TransitionCancelled": "miles_fsm.errors", "MemoryTagError": "miles_fsm.states.errors",
    "StructureVersionError": "miles_fsm.states.errors", "TensorSetChangedError": "miles_fsm.states.errors",
    "UndeclaredCollectiveError": "miles_fsm.states.errors", "WeightVersionError": "miles_fsm.states.errors",
    "BufferRoutingError": "miles_fsm.drivers.errors", "CudaAvailableError": "miles_fsm.drivers.errors",
    "EngineRequestError": "miles_fsm.drivers.errors", "EngineSessionError": "miles_fsm.drivers.errors",
    "EngineUpdateError": "miles_fsm.drivers.errors", "HostCopyMissingError": "miles_fsm.drivers.errors",
    "MissingDependencyError": "miles_fsm.drivers.errors",
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
    """At most 45 names, and none of them the engine's internals or the demo's errors."""
    assert len(miles_fsm.__all__) <= 45, len(miles_fsm.__all__)
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


@pytest.mark.parametrize("name", BACK_ON_THE_FACADE)
def test_a_name_0_1_0_users_imported_from_the_top_level_still_imports_from_it(name):
    """``from miles_fsm import Collective`` (and the other six) works as it did in 0.1.0, is the object its own
    module defines, and is a declared name of the facade."""
    namespace: dict = {}
    exec(f"from miles_fsm import {name}", namespace)
    home = importlib.import_module(miles_fsm._EXPORTS[name])
    assert namespace[name] is getattr(home, name)
    assert name in miles_fsm.__all__


def test_every_name_of_0_1_0_is_on_the_facade_or_in_the_moved_table():
    """A 0.1.0 name a user's code imports from ``miles_fsm`` either still imports from it, or
    docs/architecture.md's table of names that left the top level gives the module that holds it now."""
    table = _left_the_top_level_table()
    for name in V010_TOP_LEVEL:
        if name in miles_fsm.__all__:
            assert name not in table, f"{name} is on the facade, but the table says it left"
            continue
        assert name in LEFT_THE_FACADE, f"{name} left the facade without a home in LEFT_THE_FACADE"
        assert name in table, f"docs/architecture.md's table does not list {name}, which left miles_fsm"
        assert f"`{LEFT_THE_FACADE[name]}`" in table[name], (name, table[name])


def _left_the_top_level_table() -> dict[str, str]:
    """Each name of the table under "Names that left the top level", and the text of its row's second cell."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### Names that left the top level", 1)[1]
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for name in re.findall(r"`(\w+)`", cells[0]):
                out[name] = cells[1]
    return out


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
    from toy import ToyEngine, ToyTrainer

    from miles_fsm import Lifecycle, State, TrainerDriver

    assert not {"copy", "get"} & set(dir(TrainerDriver))
    lean = type("LeanTrainer", (), {k: v for k, v in vars(ToyTrainer).items() if k not in ("copy", "get")})
    lc = Lifecycle(trainer=lean(), engine=ToyEngine())
    lc.start()
    for _ in range(2):
        for t in ("offload", "pause", "rematerialize", "sync", "resume"):
            lc.fire(t)
    assert lc.state is State.TRAINING and lc.epoch == 2


def _without(cls: type, *members: str) -> type:
    return type(f"Lean{cls.__name__}", (), {k: v for k, v in vars(cls).items() if k not in members})


def test_a_backup_trainer_needs_no_rematerialize_only_methods():
    """A BACKUP trainer without ``cast_main_to_params`` and ``param_sync`` (BACKUP never calls them) is accepted
    and runs full cycles; the protocol that declares them is ``RematerializingTrainer``, not ``TrainerDriver``."""
    from toy import ToyEngine, ToyTrainer

    from miles_fsm import Lifecycle, RematerializingTrainer, State, Strategy, TrainerDriver

    assert not {"cast_main_to_params", "param_sync"} & set(dir(TrainerDriver))
    assert {"cast_main_to_params", "param_sync"} <= set(dir(RematerializingTrainer))
    lean = _without(ToyTrainer, "cast_main_to_params", "param_sync")
    lc = Lifecycle(trainer=lean(strategy=Strategy.BACKUP), engine=ToyEngine())
    lc.start()
    for _ in range(2):
        for t in ("offload", "pause", "rematerialize", "sync", "resume"):
            lc.fire(t)
    assert lc.state is State.TRAINING and lc.epoch == 2


def test_a_rematerialize_trainer_without_its_two_methods_is_refused_by_name():
    """The same trainer under REMATERIALIZE is refused at construction, naming both methods and the protocol."""
    from toy import ToyEngine, ToyTrainer

    from miles_fsm import DriverProtocolError, Lifecycle, Strategy

    lean = _without(ToyTrainer, "cast_main_to_params", "param_sync")
    with pytest.raises(DriverProtocolError) as caught:
        Lifecycle(trainer=lean(strategy=Strategy.REMATERIALIZE), engine=ToyEngine())
    assert caught.value.missing == ("cast_main_to_params", "param_sync")
    assert caught.value.protocol == "RematerializingTrainer"


#: Public annotations that say ``Any`` because no narrower type exists, each with why. Anything else that
#: shows ``Any`` in a public signature names a type that exists (issue 37: ``AsyncLifecycle(lifecycle: Any)``).
ANY_ALLOWED = {
    "miles_fsm.definition.Transition.__init__ steps": "the owner's own step objects, opaque to the engine",
    "miles_fsm.errors.base.plain value": "any fact of an error: it makes each JSON-ready",
    "miles_fsm.errors.base.plain return": "a JSON value",
    "miles_fsm.errors.crossing.crosses value": "any object: whether it survives a pickle round trip",
    "miles_fsm.launch.local.RankContext.__init__ _on_stop": "callbacks that take the stop's exception",
    "miles_fsm.launch.local.RankOutcome.__init__ result": "what the user's rank function returned",
    "miles_fsm.launch.ray_actors.RayOutcome.__init__ result": "what the user's rank function returned",
    "miles_fsm.launch.local.run_ranks fn": "the user's rank function returns anything",
    "miles_fsm.launch.ray_actors.run_ranks_ray fn": "the user's rank function returns anything",
    "miles_fsm.launch.torchrun.run_under_torchrun fn": "the user's rank function returns anything",
    "miles_fsm.launch.torchrun.run_under_torchrun return": "what the user's rank function returned",
    "miles_fsm.replay.model.RankTrace.__init__ guard_table": "rows of a trace's guard records, JSON values",
}  # fmt: skip

#: JSON objects (trace records, configs read back) and keyword arguments passed through hold any value.
_JSON_ANY = re.compile(r"^(dict|Mapping)\[str, Any\]( \| None)?$|^(Sequence|tuple|list)\[(dict|Mapping)\[str, Any\]")


def _public_modules() -> list[str]:
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return [n for n in listed if not n.startswith("miles_fsm.apps")] + ["miles_fsm.errors", "miles_fsm.config",
                                                                         "miles_fsm.plan"]  # fmt: skip


def _public_callables() -> dict[str, object]:
    """Every public function, class ``__init__``, method and property of every public module, by the path that
    defines it (a name several packages export is looked at once)."""
    out: dict[str, object] = {}
    for module in _public_modules():
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            members = [obj] if inspect.isfunction(obj) else []
            if inspect.isclass(obj):
                members = [v for k, v in vars(obj).items() if not k.startswith("_") or k == "__init__"]
            for value in members:
                fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if not callable(fn) or not hasattr(fn, "__annotations__"):
                    continue
                out.setdefault(f"{fn.__module__}.{fn.__qualname__}", fn)
    return out


def test_no_public_signature_shows_any_where_a_type_exists():
    """A public function's, method's or property's annotations say ``Any`` only for what has no narrower type:
    keyword arguments passed through, JSON values, and the few cases named in ``ANY_ALLOWED`` with why."""
    found = []
    for path, fn in _public_callables().items():
        params = inspect.signature(fn).parameters if not isinstance(fn, type) else {}
        for name, annotation in fn.__annotations__.items():
            text = str(annotation)
            if not re.search(r"\bAny\b", text) or f"{path} {name}" in ANY_ALLOWED or _JSON_ANY.search(text):
                continue
            if name in params and params[name].kind is inspect.Parameter.VAR_KEYWORD:
                continue
            found.append(f"{path} {name}: {text}")
    assert not found, "public signatures that show Any where a type exists:\n" + "\n".join(found)
