"""What reaches the controller when a rank's exception cannot cross a process boundary (issue 37)."""

from __future__ import annotations

import pickle
import threading

from miles_fsm.errors import RankRaisedError, crossable


class _NeedsAKeyword(Exception):
    """A user's exception whose ``__init__`` takes a keyword that ``args`` does not hold: it pickles, and
    ``pickle.loads`` then calls ``__init__`` without it (the common way a real exception fails to cross)."""

    def __init__(self, *, path: str) -> None:
        super().__init__(f"cannot read {path}")
        self.path = path


class _HoldsALock(Exception):
    """A user's exception that keeps a lock: ``pickle.dumps`` refuses it."""

    def __init__(self) -> None:
        super().__init__("busy")
        self.lock = threading.Lock()


def test_an_exception_that_pickles_but_cannot_be_unpickled_is_described_truly():
    """The stand-in says the original pickles but cannot be unpickled, and why; it never claims the original
    "does not pickle" (which it does)."""
    original = _NeedsAKeyword(path="/data/x")
    pickle.dumps(original)  # it does pickle
    stand_in = crossable(original, rank=3)
    assert isinstance(stand_in, RankRaisedError)
    assert "pickles, but cannot be unpickled" in str(stand_in) and "TypeError" in stand_in.why
    assert "does not pickle" not in str(stand_in)
    assert stand_in.type_name == "_NeedsAKeyword" and stand_in.message == "cannot read /data/x"


def test_an_exception_that_does_not_pickle_is_said_not_to():
    """An exception that ``pickle.dumps`` refuses is reported as one that does not pickle, with the reason."""
    stand_in = crossable(_HoldsALock(), rank=0)
    assert isinstance(stand_in, RankRaisedError)
    assert stand_in.why.startswith("it does not pickle (TypeError")


def test_the_stand_in_round_trips_through_pickle():
    """The controller unpickles the stand-in into a RankRaisedError with every fact and the same message."""
    stand_in = crossable(_NeedsAKeyword(path="/p"), rank=1)
    back = pickle.loads(pickle.dumps(stand_in))
    assert type(back) is RankRaisedError and str(back) == str(stand_in)
    assert back.fields() == stand_in.fields() and back.rank == 1
