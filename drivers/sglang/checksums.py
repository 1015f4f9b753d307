"""Whether an engine serves the weights pushed to it: its ``/weights_checker`` checksums.

After a push the driver reads each engine's own per-rank checksums and
compares them with the trainer's expectation (``SGLangConfig.expected_checksums``)
or, without one, across the engines that received the same push. The
names and hash are SGLang's, not the trainer's, which is why the comparison
has rules of its own (names only the engine holds, rank counts) and lives
apart from the push.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from miles_fsm.drivers.errors import EngineRequestError, WeightChecksumError
from miles_fsm.drivers.sglang.protocol import EngineChecksums

if TYPE_CHECKING:
    import torch

__all__ = ["ExpectedChecksums", "compare_checksums", "parse_checksums", "verify_checksums"]

#: Maps the pushed weights to the checksums each TP rank of an engine must then report
#: (SGLang's names and hash; see ``SGLangConfig.expected_checksums``).
ExpectedChecksums = Callable[[Sequence[tuple[str, "torch.Tensor"]]], Sequence[Mapping[str, str]]]


def parse_checksums(engine: str, body: Any) -> EngineChecksums:
    """``/weights_checker`` ``action=checksum``: ``{"ranks": [{"checksums", "per_gpu_checksum"}], ...}``."""
    ranks = body.get("ranks") if isinstance(body, Mapping) else None
    if not isinstance(ranks, list) or not ranks:
        raise EngineRequestError(
            engine=engine, op="weights_checker(checksum)", status=200, message=f"no per-rank checksums in {body!r:.300}"
        )
    try:
        return EngineChecksums(
            ranks=tuple({str(k): str(v) for k, v in r["checksums"].items()} for r in ranks),
            per_rank=tuple(str(r["per_gpu_checksum"]) for r in ranks),
            per_engine=None if body.get("per_engine_checksum") is None else str(body["per_engine_checksum"]),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise EngineRequestError(
            engine=engine, op="weights_checker(checksum)", status=200, message=f"unexpected rank entry: {exc!r}"
        ) from exc


def compare_checksums(
    engine: str, against: str, expected: Sequence[Mapping[str, str]], actual: Sequence[Mapping[str, str]]
) -> None:
    """Raise ``WeightChecksumError`` unless every TP rank reports the checksums of ``expected``.

    Names only ``actual`` has are ignored against the trainer's expectation
    (the engine holds more than the trainer pushes), but count when the
    reference is another engine, which must hold exactly the same.
    """
    if len(expected) != len(actual):
        raise WeightChecksumError(
            engine=engine,
            against=against,
            mismatched=[f"(the number of TP ranks: {len(actual)} reported, {len(expected)} expected)"],
            missing=[],
        )
    strict = against.startswith("engine ")
    mismatched: list[str] = []
    missing: list[str] = []
    for rank, (want, have) in enumerate(zip(expected, actual, strict=False)):
        prefix = f"rank {rank}: " if len(expected) > 1 else ""
        for name in sorted(want):
            if name not in have:
                missing.append(prefix + name)
            elif have[name] != want[name]:
                mismatched.append(prefix + name)
        if strict:
            mismatched.extend(prefix + name for name in sorted(set(have) - set(want)))
    if mismatched or missing:
        raise WeightChecksumError(engine=engine, against=against, mismatched=mismatched, missing=missing)


def verify_checksums(
    got: Mapping[str, EngineChecksums],
    named: Sequence[tuple[str, torch.Tensor]],
    expected: ExpectedChecksums | None,
) -> None:
    """Compare each engine's checksums (``got``, in engine order) with ``expected(named)``, or with the first's."""
    if expected is not None:
        want = [dict(m) for m in expected(named)]
        for engine, sums in got.items():
            compare_checksums(engine, "the checksums the trainer expects", want, sums.ranks)
        return
    (first, reference), *others = got.items()
    for engine, sums in others:
        compare_checksums(engine, f"engine {first}", reference.ranks, sums.ranks)
