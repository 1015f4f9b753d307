"""Why ranks disagree: the intents grouped field by field, the suspects, the tensors that differ.

The guard calls ``explain_divergence`` once the ranks' intent keys differ,
with each distinct intent gathered once (``Guard._divergence``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from miles_fsm.blame import suspects
from miles_fsm.errors import RankDivergenceError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from miles_fsm.plan import Intent

__all__ = ["explain_divergence"]


def explain_divergence(intents: Sequence[Intent], *, previous: Intent | None = None) -> RankDivergenceError:
    """Group ranks by intent, field by field, and name the suspects (rank r is intents[r]).

    ``previous`` is the intent every rank agreed on the last time this
    trigger passed: ranks that changed since are the suspects
    (``miles_fsm.blame``), the same rule replay applies.
    """
    by_field = [dict(i.fields()) for i in intents]
    names = [name for name, _ in intents[0].fields()]
    differences: dict[str, dict[str, list[int]]] = {}
    for name in names:
        if len({f[name] for f in by_field}) > 1:
            groups: dict[str, list[int]] = defaultdict(list)
            for r, f in enumerate(by_field):
                groups[f[name]].append(r)
            differences[name] = dict(groups)
    field = next(iter(differences))
    # The last agreement is evidence only if every rank looks back at the same trigger's: ranks that
    # fired different triggers each hold another history, and would each blame the others.
    same_trigger = "trigger" not in differences and previous is not None and previous.trigger == intents[0].trigger
    evidence = previous if same_trigger else None
    before = dict(evidence.fields()).get(field) if evidence is not None else None
    found = suspects(differences[field], previous=before)
    detail = ""
    # A different tensor set usually explains a different collective plan too
    # (a dropped param shrinks the buffer), so name the tensors either way.
    if len({i.tensors.digest for i in intents}) > 1:
        by_set: dict[str, list[int]] = defaultdict(list)
        for r, i in enumerate(intents):
            by_set[i.tensors.digest].append(r)
        detail = _tensor_set_detail(intents, by_set)
    return RankDivergenceError(
        epoch=min(i.epoch for i in intents),
        trigger=intents[0].trigger,
        field=field,
        groups=differences[field],
        detail=detail,
        culprits=found.ranks,
        how=found.how,
        differences=differences,
        positions={r: f"epoch {i.epoch}, {i.trigger}" for r, i in enumerate(intents)},
    )


def _tensor_set_detail(intents: Sequence[Intent], groups: dict[str, list[int]]) -> str:
    sets = {label: intents[ranks[0]].tensors for label, ranks in groups.items()}
    union = frozenset().union(*(s.names for s in sets.values()))
    parts = []
    for label, ranks in groups.items():
        lacking = sorted(union - sets[label].names)
        if lacking:
            parts.append(f"ranks [{', '.join(map(str, ranks))}] lack {', '.join(lacking[:8])}")
    if not parts:  # same names, other shapes or dtypes
        specs = [set(s.specs) for s in sets.values()]
        odd = sorted({s.name for s in specs[0].union(*specs[1:]) - specs[0].intersection(*specs[1:])})
        parts.append("same names, different shape or dtype for " + ", ".join(odd[:8]))
    return "; ".join(parts)
