"""The bindings' failures: engines, host copies, megatron's buffers, device memory, model structure, weight conversion.

Each class is a ``MilesFsmError``: its facts are fields that traces record
and that pickle (see ``miles_fsm.errors``).
"""

from __future__ import annotations

from collections.abc import Sequence

from miles_fsm.errors import MilesFsmError, list_names

__all__ = [
    "BufferRoutingError",
    "CudaAvailableError",
    "EngineRequestError",
    "EngineSessionError",
    "EngineUpdateError",
    "HostCopyMissingError",
    "IneligibleModelError",
    "MissingDependencyError",
    "NotLlamaShapedError",
    "ResumeMemoryError",
    "UnsupportedVersionError",
    "WeightChecksumError",
    "WeightLayoutError",
]


class IneligibleModelError(MilesFsmError, ValueError):
    """The model's structure makes rematerialize unsafe.

    ``suggestions``, when given, holds one hint per param, in the order of
    ``params`` (``drivers/eligibility.py`` builds them).
    """

    #: The params that rematerialize cannot rebuild.
    params: tuple[str, ...]
    #: Why (``not in a DDP param buffer``, ...).
    reason: str
    #: One hint per param, in the order of ``params`` (empty: none given).
    suggestions: tuple[str, ...]

    def __init__(self, params: Sequence[str], reason: str, suggestions: Sequence[str] = ()) -> None:
        self.params = tuple(params)
        self.reason = reason
        self.suggestions = tuple(suggestions)
        hints = ""
        if self.suggestions:
            shown = [f"{n}: {s}" for n, s in zip(self.params[:8], self.suggestions[:8], strict=False)]
            more = len(self.params) - len(shown)
            hints = "\n  - " + "\n  - ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")
        super().__init__(
            f"rematerialize cannot rebuild {len(self.params)} param(s): {list_names(self.params)} "
            f"({reason}). Put them in a DDP param buffer or among the backed-up extras, or "
            f"use the backup strategy.{hints}"
        )


class UnsupportedVersionError(MilesFsmError, RuntimeError):
    """An installed package's version is outside the range a driver was checked against."""

    def __init__(self, *, package: str, found: str, supported: str, needed_for: str) -> None:
        self.package = package
        self.found = found
        self.supported = supported
        self.needed_for = needed_for
        super().__init__(
            f"{needed_for} was checked against {package} {supported}, but {package} {found} is installed. "
            f"It patches {package} internals that move between releases, so it would fail far from here "
            f"or patch the wrong thing; install {package} {supported}."
        )


class CudaAvailableError(MilesFsmError, RuntimeError):
    """A CPU-only opt-in was asked for in a process that can use CUDA."""

    def __init__(self, *, devices: int, needed_for: str) -> None:
        self.devices = devices
        self.needed_for = needed_for
        super().__init__(
            f"{needed_for} refused: CUDA is available ({devices} device(s)). It replaces "
            "torch.cuda.current_device, the CUDA RNG calls and 'cuda' device arguments for the whole "
            "process, which would break every CUDA use in it. Run megatron on the GPU, or pass "
            "force=True to run it on the CPU anyway (tests, demos)."
        )


class EngineRequestError(MilesFsmError, RuntimeError):
    """An engine rejected or failed a request."""

    def __init__(self, *, engine: str, op: str, status: int | None, message: str) -> None:
        self.engine = engine
        self.op = op
        self.status = status
        self.message = message
        code = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"engine {engine}: {op} failed ({code}): {message}")


class EngineSessionError(MilesFsmError, RuntimeError):
    """A weight-update session was misused or left open."""

    def __init__(self, *, engine: str, op: str, detail: str) -> None:
        self.engine = engine
        self.op = op
        self.detail = detail
        super().__init__(f"engine {engine}: weight-update session error during {op}: {detail}")


class EngineUpdateError(EngineRequestError):
    """One engine of a group failed mid-update; names it, the step, and every session still open."""

    def __init__(
        self,
        *,
        engine: str,
        op: str,
        status: int | None,
        message: str,
        closed: Sequence[str],
        left_open: Sequence[str],
    ) -> None:
        self.engine = engine
        self.op = op
        self.status = status
        self.message = message
        self.closed = tuple(closed)
        self.left_open = tuple(left_open)
        code = f"HTTP {status}" if status is not None else "no response"
        if self.left_open:
            sessions = (
                f" Weight-update sessions are STILL OPEN on [{', '.join(self.left_open)}]: end them "
                "(driver.close_sessions() or POST /end_weight_update) or restart those engines before "
                "the next push."
            )
        else:
            sessions = " No weight-update session is left open."
        closed_part = f" Sessions closed after the failure: [{', '.join(self.closed)}]." if self.closed else ""
        MilesFsmError.__init__(
            self,
            f"engine {engine}: weight update failed in {op} ({code}): {message.rstrip('.')}.{closed_part}{sessions} "
            "Treat the engines' weights as unknown: push again before generating.",
        )


class HostCopyMissingError(MilesFsmError, KeyError):
    """A host copy was asked for a tag that was never backed up."""

    def __init__(self, *, tag: str, held: Sequence[str]) -> None:
        self.tag = tag
        self.held = tuple(sorted(held))
        super().__init__(
            f"no host copy of tag {tag!r} is held (held: [{', '.join(self.held)}]); "
            f"call backup({tag!r}) or copy(src, {tag!r}) first"
        )

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class BufferRoutingError(MilesFsmError, RuntimeError):
    """megatron allocated a DDP buffer differently than the region routing expects."""

    def __init__(self, *, buffer: str, expected: Sequence[str], detail: str) -> None:
        self.buffer = buffer
        self.expected = tuple(expected)
        self.detail = detail
        super().__init__(
            f"could not place megatron's {buffer} in memory tags [{', '.join(self.expected)}]: {detail}. "
            "This megatron-core version allocates its param/grad buffers differently; pausing those "
            "tags would free nothing (or the wrong memory). Report the megatron-core version."
        )


class ResumeMemoryError(MilesFsmError, MemoryError):
    """A resume was refused because the device has too little free memory for it."""

    def __init__(self, *, owner: str, tag: str, needed: int, free: int) -> None:
        self.owner = owner
        self.tag = tag
        self.needed = needed
        self.free = free
        super().__init__(
            f"{owner}: refused to resume memory tag {tag!r}: it needs at least {needed} bytes and the device "
            f"has {free} free. torch_memory_saver kills the process when a resume runs out of memory, so "
            "nothing was resumed; free device memory first (release the engine's tags, empty caches)."
        )


class MissingDependencyError(MilesFsmError, ImportError):
    """An optional dependency a driver needs is not installed."""

    def __init__(self, *, package: str, extra: str | None, needed_for: str) -> None:
        self.package = package
        self.extra = extra
        self.needed_for = needed_for
        how = f"pip install 'miles-fsm[{extra}]'" if extra else f"pip install {package}"
        super().__init__(f"{needed_for} needs the {package!r} package, which is not installed; run: {how}")


class WeightChecksumError(MilesFsmError, RuntimeError):
    """After a push, the engine's own checksums of its weights differ from what they must be."""

    def __init__(self, *, engine: str, against: str, mismatched: Sequence[str], missing: Sequence[str]) -> None:
        self.engine = engine
        self.against = against
        self.mismatched = tuple(mismatched)
        self.missing = tuple(missing)
        parts = []
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} differ: [{list_names(self.mismatched)}]")
        if self.missing:
            parts.append(f"{len(self.missing)} it does not report: [{list_names(self.missing)}]")
        super().__init__(
            f"engine {engine}: after the push, its weight checksums disagree with {against}; "
            f"{'; '.join(parts)}. The push did not land as sent: push again before generating, and if it "
            "repeats, check the weight names and layout the trainer sends."
        )


class NotLlamaShapedError(MilesFsmError, ValueError):
    """A GPT the Megatron <-> HF Llama converter cannot convert: its structure is not Llama's."""

    def __init__(self, *, problems: Sequence[str], source: str) -> None:
        self.problems = tuple(problems)
        self.source = source
        listed = "\n  - ".join(self.problems)
        super().__init__(
            f"{source} is not a Llama-shaped GPT, so its weights do not convert to LlamaForCausalLM:\n  - {listed}\n"
            "The converter maps a local-spec GPT with RMSNorm, SwiGLU, GQA, rotate-half RoPE, untied "
            "embeddings and no biases (miles_fsm.drivers.megatron.llama.LlamaShape.megatron_kwargs()); "
            "build the model that way, or convert it with a converter written for its architecture."
        )


class WeightLayoutError(MilesFsmError, ValueError):
    """A state dict's names or shapes are not the ones the converter expects for the model's shape."""

    def __init__(self, *, side: str, unknown: Sequence[str], missing: Sequence[str],
                 mismatched: Sequence[str]) -> None:  # fmt: skip
        self.side = side
        self.unknown = tuple(unknown)
        self.missing = tuple(missing)
        self.mismatched = tuple(mismatched)
        parts = []
        if self.unknown:
            parts.append(f"{len(self.unknown)} name(s) it does not know: [{list_names(self.unknown)}]")
        if self.missing:
            parts.append(f"{len(self.missing)} missing: [{list_names(self.missing)}]")
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} of the wrong shape: [{list_names(self.mismatched)}]")
        super().__init__(
            f"the {side} weights do not have the Llama layout the converter expects: {'; '.join(parts)}. "
            "Nothing was converted. Check that the LlamaShape matches the model (layers, heads, query "
            "groups, head_dim, ffn size, vocab) and that the names are a bare GPTModel's (or HF Llama's)."
        )
