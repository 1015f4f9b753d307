"""The loop's checks against the engine, as pure functions: logprobs, their comparison, the engine's weight layout.

``input_logprobs`` reads SGLang's ``/generate`` answer (``return_logprob``,
``logprob_start_len=0``): one ``[logprob, token_id, text]`` per input token,
the first logprob null (nothing predicts the first token). ``megatron``'s
side is ``trainer.megatron_logprobs``; both give, per prompt, the logprob of
tokens 1..n-1. ``engine_layout`` lays converted HF weights out as SGLang's
Llama holds them (``qkv_proj``, ``gate_up_proj`` fused), the layout its
``/weights_checker`` hashes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from miles_fsm.apps.colocated.config import Tolerance
from miles_fsm.drivers.errors import EngineRequestError

if TYPE_CHECKING:
    import torch

__all__ = ["FUSED", "compare", "engine_checksums", "engine_layout", "input_logprobs", "layer_split", "mean_of",
           "verdict", "wrong_caught"]  # fmt: skip

#: SGLang's Llama fuses these: the engine's weight is the concatenation, in this order, along dim 0.
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def input_logprobs(engine: str, body: Any, ids: Sequence[Sequence[int]]) -> list[list[float]]:
    """Per prompt, the logprobs of input tokens 1..n-1 from a batched ``/generate`` answer.

    Raises ``EngineRequestError`` naming what is off when the answer does not
    have one entry per prompt, one logprob per input token, the token ids
    sent, and a null first logprob (the shape probed on SGLang 0.5.17).
    """
    items = body if isinstance(body, list) else [body]
    if len(items) != len(ids):
        raise EngineRequestError(engine=engine, op="generate(return_logprob)", status=200,
                                 message=f"{len(items)} answers for {len(ids)} prompts")  # fmt: skip
    # A batched answer may come back in another order than the prompts went (seen on SGLang 0.5.17 on
    # the H200): each answer is matched to its prompt by the token ids it echoes, which are unique.
    wanted = {tuple(sent): i for i, sent in enumerate(ids)}
    out: list[list[float] | None] = [None] * len(ids)
    for n, item in enumerate(items):
        meta = item.get("meta_info") if isinstance(item, Mapping) else None
        rows = meta.get("input_token_logprobs") if isinstance(meta, Mapping) else None
        echoed = tuple(r[1] for r in rows) if isinstance(rows, list) and all(map(_is_row, rows)) else ()
        i = wanted.get(echoed, n)
        problem = _rows_problem(rows, ids[i])
        if problem:
            raise EngineRequestError(engine=engine, op="generate(return_logprob)", status=200,
                                     message=f"answer {n} (prompt {i}): {problem}")  # fmt: skip
        if out[i] is not None:
            raise EngineRequestError(engine=engine, op="generate(return_logprob)", status=200,
                                     message=f"answer {n} repeats prompt {i}")  # fmt: skip
        # _rows_problem found none: ``rows`` is a list of [logprob, id, text] rows.
        out[i] = [float(r[0]) for r in cast("list[list[Any]]", rows)[1:]]
    # As many answers as prompts, none repeated: every prompt has its row.
    return cast("list[list[float]]", out)


def _is_row(row: Any) -> bool:
    return isinstance(row, (list, tuple)) and len(row) >= 2


def _rows_problem(rows: Any, sent: Sequence[int]) -> str | None:
    if not isinstance(rows, list):
        return f"no meta_info.input_token_logprobs list (got {type(rows).__name__})"
    if not all(map(_is_row, rows)):
        return "a row of input_token_logprobs is not [logprob, token id, ...]"
    if len(rows) != len(sent):
        return f"{len(rows)} input logprobs for {len(sent)} input tokens"
    echoed = [r[1] for r in rows]
    if echoed != list(sent):
        at = next(k for k, (a, b) in enumerate(zip(echoed, sent, strict=True)) if a != b)
        return (f"the token ids of input_token_logprobs are not the ids sent (first difference at token {at}: "
                f"{echoed[at]!r} for {sent[at]!r}; it matches no other prompt either)")
    if rows[0][0] is not None:
        return f"the first input logprob is {rows[0][0]!r}, not null"
    if any(r[0] is None for r in rows[1:]):
        return "a logprob after the first is null"
    if not all(isinstance(r[0], (int, float)) and not isinstance(r[0], bool) for r in rows[1:]):
        return "a logprob after the first is not a number"
    return None


def mean_of(rows: list[list[float]]) -> float:
    """The mean over every prompt's logprobs (0.0 for none)."""
    return sum(map(sum, rows)) / max(1, sum(map(len, rows)))


def compare(engine: Sequence[Sequence[float]], reference: Sequence[Sequence[float]]) -> dict[str, float]:
    """max and mean |engine - reference| over every token, and how many tokens."""
    deltas = [abs(a - b) for e, r in zip(engine, reference, strict=True) for a, b in zip(e, r, strict=True)]
    if not deltas:
        return {"max_abs": 0.0, "mean_abs": 0.0, "tokens": 0}
    return {"max_abs": max(deltas), "mean_abs": sum(deltas) / len(deltas), "tokens": len(deltas)}


def verdict(stats: Mapping[str, float], tol: Tolerance) -> bool:
    """Whether a comparison is within bf16's tolerance."""
    return stats["mean_abs"] <= tol.mean and stats["max_abs"] <= tol.max


def wrong_caught(wrong: Mapping[str, float], right: Mapping[str, float], tol: Tolerance) -> bool:
    """A wrong conversion is caught when it fails the tolerance and sits ``margin`` times beyond the right one."""
    return not verdict(wrong, tol) and wrong["mean_abs"] >= tol.margin * max(right["mean_abs"], 1e-6)


def layer_split(name: str) -> tuple[str, str]:
    """``model.layers.3.mlp.up_proj.weight`` -> (``model.layers.3.``, ``mlp.up_proj.weight``); else ("", name)."""
    head, sep, rest = name.partition(".layers.")
    if not sep:
        return "", name
    layer, _, local = rest.partition(".")
    return f"{head}.layers.{layer}.", local


def engine_layout(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The pushed weights as SGLang's Llama holds them: q/k/v and gate/up concatenated (the others as they are).

    A fused weight appears only when all of its parts were pushed (a partial
    push leaves the engine's other part as it was, which the trainer cannot hash).
    """
    import torch

    by_name = dict(named)
    part_of = {part: (fused, members) for fused, members in FUSED.items() for part in members}
    out: dict[str, torch.Tensor] = {}
    for name, t in by_name.items():
        base, local = layer_split(name)
        if local not in part_of:
            out[name] = t
            continue
        fused, members = part_of[local]
        parts = [by_name[base + m] for m in members if base + m in by_name]
        if local == members[0] and len(parts) == len(members):
            out[base + fused] = torch.cat(parts, dim=0)
    return out


def engine_checksums(named: Sequence[tuple[str, torch.Tensor]]) -> list[dict[str, str]]:
    """What ``/weights_checker`` must report after a push of ``named`` (one TP rank): SGLang's own GPU hash
    of each weight in the engine's layout (``SGLangConfig.expected_checksums``)."""
    from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash

    return [{n: f"{gpu_tensor_hash(t.to('cuda').contiguous()):016x}" for n, t in engine_layout(named).items()}]
