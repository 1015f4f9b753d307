"""A machine definition: states, arrows and the steps each arrow runs, checked when built.

The engine executes any definition; the colocated lifecycle in
``miles_fsm.states`` is one. A definition is pure data: nothing here
touches a tensor or a process group. The checks are python-statemachine's:
one arrow per (state, trigger), no unreachable state, no trap, and the
failed state entered and left only by the machine itself. A definition may
add checks of its own (the lifecycle checks its memory tags).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from miles_fsm.errors import DefinitionError

__all__ = ["Definition", "Transition"]

S = TypeVar("S", bound=enum.Enum)
T = TypeVar("T", bound=enum.Enum)


@dataclass(frozen=True, slots=True)
class Transition(Generic[S, T]):
    """One arrow: a trigger, its source and destination, and the steps it runs in order."""

    trigger: T
    source: S
    dest: S
    steps: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Definition(Generic[S, T]):
    """The frozen transition table of a machine.

    ``states`` and ``triggers`` are enums whose values are strings (the
    names traces record). ``checks`` are extra definition checks, each
    returning a list of problems.
    """

    states: type[S]
    triggers: type[T]
    initial: S
    failed: S
    transitions: tuple[Transition[S, T], ...]
    checks: tuple[Callable[[Definition[S, T]], Iterable[str]], ...] = ()
    _table: Mapping[tuple[S, T], Transition[S, T]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = _check(self)
        for check in self.checks:
            problems.extend(check(self))
        if problems:
            raise DefinitionError(problems)
        object.__setattr__(self, "_table", MappingProxyType({(a.source, a.trigger): a for a in self.transitions}))

    def transition(self, state: S, trigger: T) -> Transition[S, T] | None:
        """The arrow for ``trigger`` out of ``state``, or None if the machine forbids it. One lookup."""
        return self._table.get((state, trigger))

    def allowed(self, state: S) -> tuple[T, ...]:
        """Triggers that may fire in ``state``, in table order."""
        return tuple(a.trigger for a in self.transitions if a.source is state)

    def path(self, source: S, dest: S) -> tuple[T, ...] | None:
        """The shortest trigger sequence from ``source`` to ``dest`` (``()`` if equal), or None."""
        if source is dest:
            return ()
        return self._shortest(source, dest)

    def cycle(self, home: S) -> tuple[T, ...]:
        """The shortest non-empty trigger sequence from ``home`` back to ``home``."""
        best: tuple[T, ...] | None = None
        for a in self.transitions:
            if a.source is home:
                rest = () if a.dest is home else self._shortest(a.dest, home)
                if rest is not None and (best is None or len(rest) + 1 < len(best)):
                    best = (a.trigger, *rest)
        if best is None:
            raise DefinitionError([f"no cycle leads from {home.value} back to it"])
        return best

    def describe(self, steps: Callable[[Transition[S, T]], Sequence[str]] | None = None) -> dict[str, Any]:
        """The table as JSON, as traces record it so that replay can re-drive it without this code."""
        return {
            "initial": self.initial.value,
            "failed": self.failed.value,
            "states": [s.value for s in self.states],
            "transitions": [
                [a.source.value, a.trigger.value, a.dest.value, list(steps(a)) if steps else [str(s) for s in a.steps]]
                for a in self.transitions
            ],
        }

    def _shortest(self, source: S, dest: S) -> tuple[T, ...] | None:
        frontier: list[tuple[S, tuple[T, ...]]] = [(source, ())]
        seen = {source}
        while frontier:
            nxt = []
            for state, path in frontier:
                for a in self.transitions:
                    if a.source is not state or a.dest in seen:
                        continue
                    if a.dest is dest:
                        return (*path, a.trigger)
                    seen.add(a.dest)
                    nxt.append((a.dest, (*path, a.trigger)))
            frontier = nxt
        return None


def _check(d: Definition[Any, Any]) -> list[str]:
    problems: list[str] = []
    seen: set[tuple[Any, Any]] = set()
    for a in d.transitions:
        key = (a.source, a.trigger)
        if key in seen:
            problems.append(f"trigger {a.trigger.value!r} leaves {a.source.value} twice")
        seen.add(key)
        if a.source is d.failed or a.dest is d.failed:
            problems.append(f"{a.trigger.value}: {d.failed.value} is entered and left only by the machine")
    reachable = {d.initial}
    frontier = [d.initial]
    while frontier:
        s = frontier.pop()
        for a in d.transitions:
            if a.source is s and a.dest not in reachable:
                reachable.add(a.dest)
                frontier.append(a.dest)
    for s in d.states:
        if s is d.failed:
            continue
        if s not in reachable:
            problems.append(f"state {s.value} is unreachable from {d.initial.value}")
        elif not any(a.source is s for a in d.transitions):
            problems.append(f"state {s.value} is a trap: no trigger leaves it")
    return problems
