"""Every error crosses a process boundary as itself: pickled and unpickled with its type, message and fields.

Launchers hand a rank's exception to the controller by pickling it
(multiprocessing, Ray). An error that fails to unpickle, or comes back
without its message, loses the one explanation the controller sees.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import threading
import typing

import pytest

from miles_fsm.errors import GuardError, LastSeen, MilesFsmError

_MODULES = ("miles_fsm.errors", "miles_fsm.states.errors", "miles_fsm.drivers.errors", "miles_fsm.apps.errors",
            "miles_fsm.launch.local", "miles_fsm.flight_recorder", "miles_fsm.replay.model", "miles_fsm.replay.runs",
            "miles_fsm.replay.perfetto")  # fmt: skip


class MyDriverError(MilesFsmError):
    """A user's error with no ``__init__`` of its own."""


class MyPositionalError(MilesFsmError, RuntimeError):
    """A user's error with positional facts, kept as attributes."""

    def __init__(self, code: int, where: str = "here") -> None:
        self.code = code
        self.where = where
        super().__init__(f"code {code} at {where}")


class MyForgetfulError(MilesFsmError):
    """A user's error that does not keep its ``__init__`` argument as an attribute."""

    def __init__(self, code: int) -> None:
        super().__init__(f"code {code}")


def _every_error_class() -> list[type[MilesFsmError]]:
    for name in _MODULES:
        importlib.import_module(name)
    seen: list[type[MilesFsmError]] = []
    todo = [MilesFsmError]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return sorted((c for c in seen if c.__module__.startswith("miles_fsm")), key=lambda c: c.__qualname__)


def _sample(annotation: str, name: str) -> typing.Any:
    """A value of the annotated type, distinct enough that a lost field shows."""
    a = annotation.replace(" ", "")
    if "LastSeen" in a:
        seen = {1: LastSeen(rank=1, epoch=2, trigger="sync", state="PAUSED", phase="failed in cast of", wall=1.5,
                            step="cast", error="RuntimeError")}  # fmt: skip
        return {**seen, 2: None} if "LastSeen|None]" in a else seen
    if a.startswith("Mapping[str,Mapping"):
        return {"tensor set": {"a": (0, 1), "b": (2,)}}
    if a.startswith("Mapping[str,Sequence[int]]"):
        return {"a": (0, 1), "b": (2,)}
    if a.startswith("Mapping[int,str]"):
        return {1: "RuntimeError: boom"}
    if a.startswith("Mapping"):
        return {"k": "v"}
    if a.startswith("dict[str|None,list[str]]"):
        return {"run-a": ["rank-0.jsonl"], None: ["rank-1.jsonl"]}
    if a.startswith("tuple[tuple[str,int]"):
        return (("in_use", 3 << 20),)
    if a.startswith(("Sequence[int]", "tuple[int")):
        return (1, 2)
    if a.startswith(("Sequence", "tuple")):
        return ("p.a", "p.b")
    if a.startswith("BaseException"):
        return ValueError("inner")
    if a.startswith("int"):
        return 7
    if a.startswith("float"):
        return 2.5
    if a.startswith("bool"):
        return True
    if name == "how":
        return "changed"
    if a.startswith("StopReason"):
        return "peer_failed"
    return f"{name}-value"


def _instance(cls: type[MilesFsmError]) -> MilesFsmError:
    params = [p for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"]
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return cls(f"a message of {cls.__name__}")
    args = {p.name: _sample(str(p.annotation), p.name) for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return cls(**args)


def _same(a: BaseException, b: BaseException) -> None:
    assert type(b) is type(a)
    assert str(b) == str(a) and str(a)
    assert b.args == a.args
    if isinstance(a, MilesFsmError):
        fa, fb = a.fields(), b.fields()
        assert set(fa) == set(fb)
        for k in fa:  # exceptions compare by identity: compare what they say
            same = (type(fa[k]), str(fa[k])) == (type(fb[k]), str(fb[k])) if isinstance(fa[k], BaseException) else fa[k] == fb[k]
            assert same, (k, fa[k], fb[k])


@pytest.mark.parametrize("cls", _every_error_class(), ids=lambda c: c.__qualname__)
def test_every_error_class_round_trips_through_pickle(cls):
    """Every miles-fsm error class comes back from pickle as itself: type, message, args and fields."""
    exc = _instance(cls)
    exc.add_note("miles-fsm: rank 1 is now FAILED")
    back = pickle.loads(pickle.dumps(exc))
    _same(exc, back)
    assert back.__notes__ == exc.__notes__


@pytest.mark.parametrize(
    "exc",
    [MilesFsmError("boom"), GuardError("x"), MyDriverError("the driver broke"), MyPositionalError(3, where="there"),
     MyForgetfulError(4)],
    ids=lambda e: type(e).__name__,
)  # fmt: skip
def test_errors_without_keyword_facts_round_trip_with_their_message(exc):
    """The base class, a subclass without ``__init__``, and users' errors with positional facts (kept or not)
    come back with their message: MilesFsmError("boom") used to lose it, GuardError("x") and a user's
    ``class MyDriverError(MilesFsmError): pass`` failed to unpickle."""
    _same(exc, pickle.loads(pickle.dumps(exc)))


def test_fields_of_errors_without_keyword_facts():
    """``fields()`` never raises and never invents a fact: traces record it for every error."""
    from miles_fsm.errors import describe

    assert MyDriverError("x").fields() == {}
    assert MyPositionalError(3).fields() == {"code": 3, "where": "here"}
    assert describe(MyForgetfulError(4)) == {"error": "MyForgetfulError", "message": "code 4", "fields": {}}


class Unpicklable(RuntimeError):
    """An exception that holds a lock: pickling it fails, as many real exceptions' do."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def test_a_stand_in_keeps_an_unpicklable_errors_type_message_and_traceback():
    """``crossable`` returns a picklable error unchanged, and replaces one that cannot cross with
    ``RankRaisedError``, which keeps the type name, message and traceback text."""
    from miles_fsm.errors import RankRaisedError, crossable

    ok = GuardError("fine")
    assert crossable(ok, rank=0) is ok
    try:
        raise Unpicklable("the engine's socket broke")
    except Unpicklable as exc:
        stand_in = crossable(exc, rank=3)
    assert isinstance(stand_in, RankRaisedError)
    back = pickle.loads(pickle.dumps(stand_in))
    assert back.rank == 3 and back.type_name == "Unpicklable" and back.message == "the engine's socket broke"
    assert "raise Unpicklable" in back.traceback_text and "Unpicklable: the engine's socket broke" in back.traceback_text
    assert "rank 3 raised Unpicklable: the engine's socket broke" in str(back)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "fact"])
def test_the_local_launcher_returns_every_rank_when_one_raises_what_does_not_pickle(kind, assert_no_leftovers):
    """Rank 1 raises an exception that does not pickle (or a miles-fsm error with a fact that does not):
    its outcome keeps the type name, message and traceback text, and rank 0's result still comes back."""
    import ranks_live
    from miles_fsm.launch.local import run_ranks

    out = run_ranks(ranks_live.one_raises_unpicklable, 2, timeout_s=60, kwargs={"bad": 1, "kind": kind})
    assert out[0].ok and out[0].result == {"rank": 0, "fine": True}, out[0]
    err = out[1].error
    assert out[1].exitcode == 1 and err is not None, out[1]
    if kind == "plain":
        assert (err.type, err.message) == ("Unpicklable", "rank 1's engine socket broke")
        assert "raise Unpicklable" in err.traceback
    else:
        assert err.type == "LockedFactError" and "lock" in str(err.attrs["lock"])
