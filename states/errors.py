"""The lifecycle's failures: what verification, the memory ledger and the weight push refuse.

Each class is a ``MilesFsmError``: its facts are fields that traces record
and that pickle (see ``miles_fsm.errors``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from miles_fsm.errors import MilesFsmError, list_names

__all__ = [
    "DriverProtocolError",
    "MemoryDriftError",
    "MemoryTagError",
    "RecoveryError",
    "StructureVersionError",
    "TensorSetChangedError",
    "UndeclaredCollectiveError",
    "VerificationError",
    "WeightVersionError",
]


class VerificationError(MilesFsmError, RuntimeError):
    """Tensors came back with different bytes than they had before the offload."""

    #: The epoch whose cycle brought the tensors back different.
    epoch: int
    #: The names of the tensors that differ.
    mismatched: tuple[str, ...]
    #: Whose tensors: ``trainer``, or ``engine <name>`` for the weights an engine serves.
    where: str

    def __init__(self, *, epoch: int, mismatched: Sequence[str], where: str = "trainer") -> None:
        self.epoch = epoch
        self.mismatched = tuple(mismatched)
        self.where = where
        super().__init__(
            f"{len(self.mismatched)} {where} tensor(s) differ from their pre-offload SHA256 "
            f"after epoch {epoch}: {list_names(self.mismatched)}. Do not train on them: the restore "
            "or rematerialize path lost data. Recover from a checkpoint."
        )


class TensorSetChangedError(VerificationError):
    """The set of tensors itself changed between offload and verify."""

    def __init__(
        self, *, epoch: int, added: Sequence[str], removed: Sequence[str], where: str = "trainer"
    ) -> None:
        self.added = tuple(added)
        self.removed = tuple(removed)
        MilesFsmError.__init__(
            self,
            f"the {where} tensor set changed during epoch {epoch}: added [{list_names(self.added)}], "
            f"removed [{list_names(self.removed)}]. A param entered or left the buffers while "
            "offloaded; restore cannot be trusted.",
        )
        self.epoch = epoch
        self.mismatched = self.added + self.removed
        self.where = where


class MemoryTagError(MilesFsmError, RuntimeError):
    """A pause of a paused tag, or a resume of an active one, was refused."""

    def __init__(self, *, side: str, tag: str, op: str, paused: Collection[str]) -> None:
        self.side = side
        self.tag = tag
        self.op = op
        self.paused = tuple(sorted(paused))
        state = "already paused" if op == "pause" else "not paused"
        super().__init__(
            f"refused to {op} {side} memory tag {tag!r}: it is {state} (paused now: "
            f"[{', '.join(self.paused)}]). torch_memory_saver and SGLang kill the process on "
            "this, so nothing was sent."
        )


class WeightVersionError(MilesFsmError, RuntimeError):
    """The engine reports a different weight version than the one just pushed."""

    def __init__(self, *, engine: str, expected: str, actual: str | None) -> None:
        self.engine = engine
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"engine {engine} reports weight version {actual!r} after a push of {expected!r}; "
            "it is serving other weights than the trainer's. Push again before generating."
        )


class RecoveryError(MilesFsmError, RuntimeError):
    """A FAILED rank cannot be recovered to the state asked for."""

    #: The state the recovery was asked to reach.
    target: str
    #: Why the rank cannot be recovered there.
    reason: str

    def __init__(self, *, target: str, reason: str) -> None:
        self.target = target
        self.reason = reason
        super().__init__(f"cannot recover to {target}: {reason}")


class StructureVersionError(MilesFsmError, RuntimeError):
    """A trainer's ``structure_version`` stayed the same while its ``tensor_set()`` changed.

    The lifecycle plans from the tensor set cached for a version; a version
    that does not move with the set would let the guard compare a stale plan,
    which can hide a per-rank change (the seed's hang). Found on a verified
    cycle, where the set is walked again and compared.
    """

    def __init__(self, *, driver: str, version: str, added: Sequence[str], removed: Sequence[str]) -> None:
        self.driver = driver
        self.version = version
        self.added = tuple(added)
        self.removed = tuple(removed)
        super().__init__(
            f"the trainer driver {driver} still reports structure_version {version}, but its tensor_set() "
            f"changed: added [{list_names(self.added)}], removed [{list_names(self.removed)}]. Change the "
            "version in every mutation that changes the tensor set (or drop structure_version, and the "
            "set is walked on every guarded transition); the transition did not start."
        )


class DriverProtocolError(MilesFsmError, TypeError):
    """A driver handed to the lifecycle lacks members of its protocol."""

    #: Which driver: ``trainer`` or ``engine``.
    role: str
    #: The driver's class, by its qualified name.
    driver: str
    #: The protocol's members it lacks, sorted.
    missing: tuple[str, ...]
    #: The protocol it was held to (``TrainerDriver``, ``RematerializingTrainer``, ``EngineDriver``).
    protocol: str

    def __init__(self, *, role: str, driver: str, missing: Sequence[str], protocol: str) -> None:
        self.role = role
        self.driver = driver
        self.missing = tuple(missing)
        self.protocol = protocol
        super().__init__(
            f"the {role} driver {driver} lacks {len(self.missing)} member(s) of {protocol}: "
            f"{', '.join(self.missing)}. Implement them (docs/embedding.md lists what each must do); "
            "nothing ran."
        )


class UndeclaredCollectiveError(MilesFsmError, RuntimeError):
    """A step issued a collective its plan did not declare (seen by the plan audit)."""

    def __init__(self, *, rank: int, epoch: int, trigger: str, step: str, collective: str,
                 declared: Sequence[str]) -> None:  # fmt: skip
        self.rank = rank
        self.epoch = epoch
        self.trigger = trigger
        self.step = step
        self.collective = collective
        self.declared = tuple(declared)
        super().__init__(
            f"rank {rank} issued {collective} in {trigger}/{step} (epoch {epoch}), which its plan did not "
            f"declare (declared: [{', '.join(self.declared)}]). The guard compared a plan without it, so the "
            "ranks can hang in it: declare it in the driver's collectives(step), or remove it."
        )


class MemoryDriftError(MilesFsmError, RuntimeError):
    """A memory figure of one state grew cycle by cycle past the drift tolerance (``DriftConfig(policy="raise")``)."""

    def __init__(self, *, rank: int, tag: str, state: str, first_cycle: int, bytes_per_cycle: int, slope: float,
                 kind: str = "device", grown: int = 0, inside: str | None = None,
                 grew_with: tuple[tuple[str, int], ...] = ()) -> None:  # fmt: skip
        self.rank = rank
        self.tag = tag
        self.state = state
        self.first_cycle = first_cycle
        self.bytes_per_cycle = bytes_per_cycle
        self.slope = slope
        self.kind = kind
        self.grown = grown
        #: The figure inside ``tag`` whose growth was taken out (``miles_fsm.memory_drift.INSIDE``), if any.
        self.inside = inside
        #: (tag, bytes): the figures holding this one that grew with it over the same cycles.
        self.grew_with = tuple(grew_with)
        outside = f" outside {inside!r}" if inside else ""
        #: What grew and where to look, without the advice on the policy (the warning under ``warn`` says it).
        self.summary = (
            f"rank {rank}'s {kind} memory under tag {tag!r}{outside} at {state} grows by "
            f"~{bytes_per_cycle / 2**20:.1f} MiB per cycle since cycle {first_cycle} (repeated-median slope "
            f"{slope / 2**20:.2f} MiB/cycle, {grown / 2**20:.1f} MiB over its baseline){_held_by(self.grew_with)}. "
            f"Something keeps memory alive across cycles: {_where(tag)}"
        )
        super().__init__(f"{self.summary}; to go on anyway, raise the tolerance or set DriftConfig(policy='warn').")


def _held_by(grew_with: tuple[tuple[str, int], ...]) -> str:
    """What the figures holding the one named did: they grew with it, and are not named for it."""
    if not grew_with:
        return ""
    grown = " and ".join(f"{tag!r} (+{n / 2**20:.1f} MiB)" for tag, n in grew_with)
    return f"; {grown} grew with it over the same cycles: they hold it, and are not named for it"


def _where(tag: str) -> str:
    if tag == "torch:allocated":
        return "look for CUDA tensors kept from cycle to cycle (a list, a cache, a closure, a graph kept alive)"
    if tag == "torch:pinned":
        return "look for pinned host tensors kept from cycle to cycle (pin_memory=True, .pin_memory())"
    if tag == "torch:reserved":
        return "torch's allocator caches ever more than it hands out (fragmentation); try torch.cuda.empty_cache()"
    if tag == "in_use":
        return "device memory outside torch's allocator grows (another library's cudaMalloc, NCCL, another process)"
    return (f"look for buffers kept under {tag!r} (host copies never dropped, pinned pages never freed, "
            "caches that grow)")
