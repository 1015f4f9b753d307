"""The records the fold reads most, decoded straight into one typed struct by msgspec.

Action, transition and guard records are nearly every line of a trace, and
every line is parsed (a line not accounted for could be anything); msgspec
fills the fields about twice as fast as a dict of every field, and checks
their types on the way. Only a record of exactly the shape ``Lifecycle``
writes decodes here: an unknown field, a value of another type, an integer
orjson would not read as one (beyond 64 bits) all fail, and the fold then
reads the line with orjson as before, so a damaged or hostile line is judged
by the one reader it always was. The fields every record carries are
required (a record without one is read by orjson, whose schema check names
it); an event's own fields are ``UNSET`` when absent, which the fold tells
from null. The identity fields (``v``, ``run``, ``rank``, ``world``) come
with every record, so the fold checks them on every record at the cost of
a few comparisons.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from miles_fsm.trace.schema import (
    ACTION_FINISHED,
    ACTION_STARTED,
    GUARD_ENTERED,
    GUARD_PASSED,
    TRANSITION_FINISHED,
    TRANSITION_STARTED,
)

__all__ = ["HOT_EVENTS", "NOT_HOT", "UNSET", "HotRecord", "RecordView", "decode_hot", "hot_errors"]

# orjson reads integers in [-2**63, 2**64) as int and any other as float; msgspec bounds stop at
# int64, so only int64 values decode here (a larger one goes to orjson, which reads it as it always did).
_Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class HotRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An action, transition or guard record (``verified`` has fields of its own: orjson reads it); the fields every record carries are required (a null ``state``
    or ``trigger`` too: no hot record has one), an event's own fields are ``UNSET`` when absent."""

    event: str
    seq: _Int
    v: _Int
    run: str
    rank: _Int
    world: _Int
    epoch: _Int
    state: str
    trigger: str
    mono_ns: _Int
    # int | float: an integer stays one, as orjson has it (the fold tells them apart).
    wall: float | _Int
    dest: str | UnsetType = UNSET
    source: str | UnsetType = UNSET
    steps: list[str] | UnsetType = UNSET
    key: _Int | UnsetType = UNSET
    collectives: list[str] | UnsetType = UNSET
    tensors: str | None | UnsetType = UNSET
    duration_s: float | _Int | UnsetType = UNSET
    action: str | UnsetType = UNSET
    bytes_moved: _Int | None | UnsetType = UNSET
    host_bytes: _Int | None | UnsetType = UNSET
    # Whatever the host's memory probe returns: not read, only required to be JSON.
    mem_before: Any = UNSET
    mem_after: Any = UNSET


#: Events whose records the fold takes from a ``HotRecord``.
HOT_EVENTS = frozenset((ACTION_STARTED, ACTION_FINISHED, TRANSITION_STARTED, TRANSITION_FINISHED, GUARD_ENTERED,
                        GUARD_PASSED))  # fmt: skip
decode_hot = msgspec.json.Decoder(HotRecord).decode
hot_errors = (msgspec.DecodeError, msgspec.ValidationError)
#: What the fold takes for a line that does not decode here: its event is none of ``HOT_EVENTS``.
NOT_HOT = HotRecord(event="", seq=0, v=0, run="", rank=0, world=0, epoch=0, state="", trigger="", mono_ns=0, wall=0)


class RecordView:
    """A record orjson read, seen as a ``HotRecord`` is: a field is ``rec.get(name)`` (None: absent)."""

    __slots__ = ("_rec",)

    def __init__(self, rec: dict[str, Any]) -> None:
        self._rec = rec

    def __getattr__(self, name: str) -> Any:
        return self._rec.get(name)
