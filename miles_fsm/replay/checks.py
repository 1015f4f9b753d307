"""Type checks of trace records: a record no writer could have made is a bad line, never a crash.

The reader keeps a few records whole (failures, recoveries, the close) and
the report and ``--json`` show their fields, so each field the diagnosis
reads must have the type the schema gives it, and nothing may nest deeper
than any writer nests. The hot records (transitions, guards) are checked
inline by the reader, only for the fields it uses; this module checks the
rest, and the Perfetto export checks every record it draws with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["I64", "MAX_DEPTH", "MAX_RANKS", "bad_action", "bad_guard", "bad_sig", "invalid", "label", "plain_int",
           "machine_problem", "machine_problem", "schema_problem", "unfit"]  # fmt: skip

#: Integers the reader stores in 64-bit arrays must fit them.
I64 = 1 << 63
#: Rank numbers (file names, ``world``, culprits) at or above this are not believed.
MAX_RANKS = 1 << 20
#: Deeper than any record a writer makes (``fields`` of an error: three levels).
MAX_DEPTH = 16

_NAMES = ("event", "state", "trigger", "run", "error", "message", "transport", "action", "phase", "where",
          "source", "dest", "after", "field", "detail", "how")  # fmt: skip
_NAME_SET = frozenset(_NAMES)
_RANK_LISTS = ("culprits", "missing")


def invalid(rec: Mapping[str, Any]) -> str | None:
    """Why a record cannot be read as the schema says (which field, what it holds), or None."""
    for key in _NAME_SET.intersection(rec):
        v = rec[key]
        if v is not None and v.__class__ is not str:
            return f"{key} holds {_kind(v)}, not a string"
    for key in ("epoch", "seq"):
        v = rec.get(key)
        if v is not None and plain_int(v) is None:
            return f"{key} holds {_kind(v)}, not an integer"
    why = _ranks_field(rec, "culprits")
    if why is not None:
        return why
    tensors = rec.get("tensors")
    if tensors is not None and tensors.__class__ is not str and plain_int(tensors) is None and not _strings(tensors):
        return f"tensors holds {_kind(tensors)}, not a digest, a count or a list of names"
    clean = rec.get("clean")
    if clean is not None and clean.__class__ is not bool:
        return f"clean holds {_kind(clean)}, not true or false"
    fields = rec.get("fields")
    if fields is not None:
        if not isinstance(fields, dict):
            return f"fields holds {_kind(fields)}, not an object"
        for key in ("field", "detail", "how"):
            v = fields.get(key)
            if v is not None and v.__class__ is not str:
                return f"fields.{key} holds {_kind(v)}, not a string"
        for key in _RANK_LISTS:
            why = _ranks_field(fields, key)
            if why is not None:
                return f"fields.{why}"
    if _depth(rec, MAX_DEPTH) > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    return None


def schema_problem(event: str, rec: Mapping[str, Any]) -> str | None:
    """Why a record of schema v2 does not hold what the schema gives its event (a field missing, or of another
    type), or None. Fields beyond the schema's are allowed: a host's bound context adds its own."""
    g = rec.get
    if event not in _FIELDS:  # a driver's own event: the tracer's stamps; the writer's fields, if it gives them
        return _common_problem(rec, _GIVEN) or invalid(rec)
    if not (_int(g("v")) and g("run").__class__ is str and _int(g("rank")) and _int(g("world")) and _int(g("epoch"))
            and _int(g("seq")) and _int(g("mono_ns")) and _number(g("wall")) and "state" in rec and "trigger" in rec
            and _name_or_null(rec["state"]) and _name_or_null(rec["trigger"])):  # fmt: skip
        return _common_problem(rec)
    for key, ok, what in _FIELDS.get(event, ()):
        if key not in rec:
            if key in _LATER:
                continue
            return f"{key} is missing (every {event} record has it)"
        if not ok(rec[key]):
            return f"{key} holds {_kind(rec[key])}, not {what}"
    # Fields beyond the schema's may be anything a host binds, or a name, a rank list, an error's facts.
    return None if rec.keys() <= _KNOWN.get(event, _NO_KEYS) else invalid(rec)


def _common_problem(rec: Mapping[str, Any], optional: tuple[str, ...] = ()) -> str | None:
    for key, ok, what in _COMMON:
        if key not in rec:
            if key in optional:
                continue
            return f"{key} is missing"
        if not ok(rec[key]):
            return f"{key} holds {_kind(rec[key])}, not {what}"
    return None


def machine_problem(described: Any) -> str | None:
    """Why ``trace_opened``'s ``machine`` is not a table ``Definition.describe`` writes, or None: replay
    re-drives the machine from it, and a table it cannot read would leave every transition unchecked."""
    if described.__class__ is not dict:
        return f"it holds {_kind(described)}, not a transition table"
    initial, failed, states, arrows = (described.get(k) for k in ("initial", "failed", "states", "transitions"))
    if states.__class__ is not list or not all(x.__class__ is str for x in states) or len(set(states)) != len(states):
        return "its states are not a list of distinct names"
    if initial not in states or failed not in states:
        return "its initial or failed state is not one of its states"
    if arrows.__class__ is not list:
        return "its transitions are not a list"
    seen = set()
    for a in arrows:
        if (a.__class__ is not list or len(a) != 4 or a[0] not in states or a[2] not in states
                or a[1].__class__ is not str or not _names(a[3])):  # fmt: skip
            return "a transition is not [source, trigger, dest, steps] of its states"
        if (a[0], a[1]) in seen:
            return f"two arrows for {a[1]} out of {a[0]}"
        seen.add((a[0], a[1]))
    return None


def _names(v: Any) -> bool:
    return v.__class__ is list and all(x.__class__ is str for x in v)


def _name(v: Any) -> bool:
    return v.__class__ is str


def _name_or_null(v: Any) -> bool:
    return v is None or v.__class__ is str


def _int(v: Any) -> bool:
    return plain_int(v) is not None


def _int_or_null(v: Any) -> bool:
    return v is None or plain_int(v) is not None


def _count(v: Any) -> bool:
    return v.__class__ is int and 0 <= v < I64


def _number(v: Any) -> bool:
    return v.__class__ is float or plain_int(v) is not None


def _bytes_by_tag(v: Any) -> bool:
    return v.__class__ is dict and all(plain_int(x) is not None for x in v.values())


def _any(v: Any) -> bool:
    return True


_Field = tuple[str, Callable[[Any], bool], str]
_N, _NN, _I, _IN, _NUM = (_name, "a name"), (_name_or_null, "a name or null"), (_int, "an integer"), \
    (_int_or_null, "an integer or null"), (_number, "a number")  # fmt: skip
#: Stamped on every record by the tracer or given by its writer (``COMMON_FIELDS``); ``event`` is known here.
_COMMON: tuple[_Field, ...] = (("v", *_I), ("run", *_N), ("rank", *_I), ("world", *_I), ("epoch", *_I),
                               ("seq", *_I), ("mono_ns", *_I), ("wall", *_NUM), ("state", *_NN),
                               ("trigger", *_NN))  # fmt: skip
#: Given by the writer, not stamped by the tracer: a driver's own event may leave them out.
_GIVEN = ("epoch", "state", "trigger")
_ERROR_FIELDS: tuple[_Field, ...] = (("error", *_N), ("message", *_N))
#: Event -> its own fields, as the schema (``EVENTS``) names them and the writers write them.
_FIELDS: dict[str, tuple[_Field, ...]] = {
    "trace_opened": (("pid", *_IN), ("host", *_NN), ("rotated_to", *_NN)),
    "transition_started": (("dest", *_N), ("steps", _names, "names")),
    "transition_cancelled": _ERROR_FIELDS,
    "guard_entered": (("key", *_I), ("collectives", _names, "names"),
                      ("tensors", *_NN)),
    "guard_passed": (("duration_s", *_NUM),),
    "guard_failed": _ERROR_FIELDS,
    "action_started": (("action", *_N), ("mem_before", _any, "")),
    "action_finished": (("action", *_N), ("duration_s", *_NUM), ("bytes_moved", *_IN), ("host_bytes", *_IN),
                        ("mem_before", _any, ""), ("mem_after", _any, "")),
    "verified": (("tensors", _count, "a count"), ("scheme", *_N), ("waited_s", *_NUM)),
    "verify_failed": (("tensors", _names, "names"), ("where", *_N),
                      ("scheme", *_N)),
    "transition_finished": (("source", *_N), ("duration_s", *_NUM)),
    "transition_failed": (("source", *_N), ("action", *_NN), ("phase", *_N), *_ERROR_FIELDS),
    "cancel_deferred": (("phase", *_NN), ("action", *_NN)),
    "recovered": (("after", lambda v: v is None or v.__class__ is dict, "an error's facts or null"),),
    "store_unreachable": _ERROR_FIELDS,
    "trace_closed": (("clean", lambda v: v.__class__ is bool, "true or false"),),
    "memory_snapshot": (("device", _bytes_by_tag, "bytes by tag"), ("host", _bytes_by_tag, "bytes by tag"),
                        ("rss", *_IN)),
    "memory_drift": (("kind", *_N), ("tag", *_N), ("at", *_N), ("first_cycle", *_I), ("bytes_per_cycle", *_I),
                     ("slope", *_NUM), ("grown", *_I), ("policy", *_N)),
}


#: Fields schema v2 gained later (verification's ``scheme`` and ``waited_s``, 2026-12-04, with no version bump):
#: a trace of an earlier v2 writer lacks them, and is not damaged for that. Present, they are checked.
_LATER = frozenset(("scheme", "waited_s"))
_NO_KEYS: frozenset[str] = frozenset()
#: Event -> every field its records carry, when they carry nothing else: the checks above are then the whole check.
_KNOWN = {e: frozenset(k for k, _, _ in (*_COMMON, *f)) | {"event"} for e, f in _FIELDS.items()}


def bad_action(rec: Mapping[str, Any]) -> str | None:
    """Why an action record (read by orjson: it has keys ``Lifecycle`` does not write) is not one, or None."""
    if rec.get("action").__class__ is not str:
        return "action is not a name"
    for key in ("duration_s", "bytes_moved", "host_bytes"):
        v = rec.get(key)
        if v is not None and v.__class__ is not float and plain_int(v) is None:
            return f"{key} holds {_kind(v)}, not a number"
    return invalid(rec)


def bad_sig(sig: tuple[Any, ...]) -> str | None:
    """Why a transition's (trigger, source, dest, steps) are not names, or None."""
    trigger, source, dest, steps = sig
    if trigger.__class__ is not str:
        return "trigger is not a name"
    if any(x is not None and x.__class__ is not str for x in (source, dest)):
        return "state or dest is not a name"
    if source is None or dest is None:
        return "state or dest is missing"
    if steps.__class__ is not tuple or not all(s.__class__ is str for s in steps):
        return "steps are not names"
    return None


def bad_guard(g: tuple[Any, ...]) -> str | None:
    """Why a guard's (key, collectives, tensors) are not what the schema says, or None."""
    key, cols, tensors = g
    if key.__class__ is not int or not -I64 <= key < 2 * I64:
        return "key is not a 64-bit integer"
    if not all(c.__class__ is str for c in cols) or (tensors is not None and tensors.__class__ is not str):
        return "collectives or tensors are not names"
    return None


def unfit(key: tuple[Any, ...], bad: Callable[[tuple[Any, ...]], str | None]) -> str | None:
    """Why ``key`` cannot be a table's entry: unhashable, or ``bad`` says so."""
    try:
        hash(key)
    except TypeError:
        return "a list or an object where a name belongs"
    return bad(key)


def plain_int(v: Any) -> int | None:
    """``v`` if it is an integer that fits 64 bits (not a bool), else None."""
    return v if v.__class__ is int and -I64 <= v < I64 else None


def label(v: Any) -> str:
    """A name to show for a value a record gives as a name: itself if a string, else its kind."""
    return v if v.__class__ is str else f"<{_kind(v)}>"


def _ranks_field(rec: Mapping[str, Any], key: str) -> str | None:
    v = rec.get(key)
    if v is None:
        return None
    if v.__class__ is not list or not all(r.__class__ is int and 0 <= r < MAX_RANKS for r in v):
        return f"{key} holds {_kind(v)}, not a list of ranks"
    return None


def _strings(v: Any) -> bool:
    return v.__class__ is list and all(x.__class__ is str for x in v)


def _depth(v: Any, limit: int) -> int:
    if limit < 0:
        return 1
    deepest = 0
    for x in v.values() if v.__class__ is dict else v:
        if (x.__class__ is dict or x.__class__ is list) and (d := _depth(x, limit - 1)) > deepest:
            deepest = d
    return 1 + deepest


def _kind(v: Any) -> str:
    if v.__class__ is int:
        return "an integer out of range"
    return {dict: "an object", list: "a list", str: "a string", float: "a number", bool: "true or false",
            type(None): "null"}.get(v.__class__, type(v).__name__)  # fmt: skip
