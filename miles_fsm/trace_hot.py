"""The records the fold reads most, decoded straight into one typed struct by msgspec.

Transition and guard records are most of what a fold parses; msgspec fills
the few fields it needs about twice as fast as a dict of every field. Only a
record of exactly the shape ``Lifecycle`` writes decodes here: an unknown
field, a value of another type, an integer orjson would not read as one
(beyond 64 bits) all fail, and the fold then reads the line with orjson as
before, so a damaged or hostile line is judged by the one reader it always was.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from miles_fsm.schema import GUARD_ENTERED, GUARD_PASSED, TRANSITION_FINISHED, TRANSITION_STARTED, VERIFIED

__all__ = ["HOT_EVENTS", "HotRecord", "decode_hot", "hot_errors"]

# orjson reads integers in [-2**63, 2**64) as int and any other as float; msgspec bounds stop at
# int64, so only int64 values decode here (a larger one goes to orjson, which reads it as it always did).
_Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class HotRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A transition, guard or verify record; ``None`` is a field absent or null, as ``dict.get`` has it."""

    event: str
    seq: _Int
    v: _Int | None = None
    run: str | None = None
    rank: _Int | None = None
    world: _Int | None = None
    epoch: _Int | None = None
    state: str | None = None
    trigger: str | None = None
    mono_ns: _Int | None = None
    # int | float: an integer stays one, as orjson has it (the fold tells them apart).
    wall: float | _Int | None = None
    dest: str | None = None
    source: str | None = None
    steps: list[str] | None = None
    key: _Int | None = None
    collectives: list[str] | None = None
    tensors: str | _Int | None = None
    duration_s: float | _Int | None = None


#: Events whose records the fold takes from a ``HotRecord``.
HOT_EVENTS = frozenset((TRANSITION_STARTED, TRANSITION_FINISHED, GUARD_ENTERED, GUARD_PASSED, VERIFIED))
decode_hot = msgspec.json.Decoder(HotRecord).decode
hot_errors = (msgspec.DecodeError, msgspec.ValidationError)
