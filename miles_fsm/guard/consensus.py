"""The consensus guard: every rank agrees on a transition before any collective runs.

Fast path: one all-reduce of two int64 on a gloo group of our own,
``MAX([k, -k])``. The ranks agree exactly when ``max(k) == min(k)``. Only on a
difference do the ranks gather their full intents to explain it.

Each rank publishes where it is to the torch.distributed store before the
all-reduce, so a rank that never arrives can be named, with its last known
state, by every rank that did. On such a failure one survivor, the first to
claim it in the store, reads every rank's key and publishes the report; the
others wait for that one key, so the store serves O(N) requests, not N^2.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, cast

import orjson
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Store

from miles_fsm.errors import (
    GuardTimeoutError,
    LastSeen,
    PeerFailedError,
    PeerLostError,
    PeerStepFailedError,
    ProcessGroupMissingError,
    RankDivergenceError,
)
from miles_fsm.guard.disagreement import explain_divergence
from miles_fsm.guard.publisher import Publisher, Sighting, note_on, read_record, record, said_failed, warn_each
from miles_fsm.guard.roll import roll_call
from miles_fsm.guard.store import default_store, env_world_size, group_namespace, stable_hash
from miles_fsm.plan import Intent
from miles_fsm.trace.writer import new_run_id

__all__ = ["Guard"]

#: What a rank that went missing after the last guard every rank passed is shown as (``_best_sighting``).
_PASSED = "passed guard of"

#: After a peer is lost, how long to let the other survivors publish their
#: arrival before naming who is missing. Short: they were all about to arrive.
_ARRIVAL_GRACE_S = 2.0

#: How long a survivor waits for the reporter's report before reading the store
#: itself (the reporter may have died): the reporter's grace, plus a loaded store's margin.
_REPORT_WAIT_S = _ARRIVAL_GRACE_S + 3.0


class Guard:
    """Cross-rank agreement on transitions, one instance per rank."""

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        group: ProcessGroup | None,
        store: Store | None,
        timeout_s: float,
        name: str | None = None,
    ) -> None:
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self._group: Any = group  # loosely typed inside: set whenever world > 1, the only case that uses it
        self._store: Any = store  # and torch's Store stubs take str values where this guard writes bytes
        self._buf = torch.zeros(2, dtype=torch.int64)
        self._view = self._buf.numpy()  # element access through numpy costs ~0.1 us, torch's ~2 us
        # Its store keys follow from what every rank of its group shares (its global ranks, the
        # lifecycle's name): lifecycles of one job (actor, ref) never collide, and a guard over a
        # subgroup on some ranks does not shift the keys of the others' guards.
        members = tuple(range(world)) if group is None else tuple(dist.get_process_group_ranks(group))
        self.namespace = group_namespace("guard", members, name)
        self._publisher = Publisher(store, self._last_key(rank), rank=rank) if world > 1 else None
        if self._publisher is not None:
            # Every rank's key exists from the start, so one multi_get reads them all.
            self._publisher.set_now(record(-1, "", "", "joined"))
        #: The last guard every rank passed: where a rank that later goes missing was last seen.
        self._last_passed: LastSeen | None = None
        #: Per trigger, the intent every rank agreed on the last time it passed.
        self._agreed: dict[str, Intent] = {}
        #: How many times this guard was entered: the same on every rank at the same guard,
        #: so it names one failure's report in the store.
        self._entries = 0

    @classmethod
    def solo(cls) -> Guard:
        """World size 1: nothing to agree with, nothing to pay."""
        return cls(rank=0, world=1, group=None, store=None, timeout_s=0.0)

    @classmethod
    def from_default_group(cls, *, timeout_s: float, store: Store | None = None, name: str | None = None) -> Guard:
        """Build a guard over the default process group. Collective: every rank calls it.

        The guard gets its own gloo group, so it never queues behind (or
        inside) the trainer's NCCL work, and its timeout is the guard timeout.
        """
        return cls.from_group(None, timeout_s=timeout_s, store=store, name=name)

    @classmethod
    def from_group(
        cls, group: ProcessGroup | None = None, *, timeout_s: float, store: Store | None = None, name: str | None = None
    ) -> Guard:
        """Build a guard over ``group`` (None: the default group). Collective over the group's ranks.

        A gloo group is used as it is: pass the host's own gloo group (miles'
        ``get_gloo_group()``) to spend no extra group. Any other group (NCCL)
        gets a gloo group over the same ranks, so the guard never queues
        behind NCCL work and outlives NCCL groups that the host destroys and
        rebuilds around sleep. ``store``: where ranks publish their arrival
        and failures; default the torch.distributed default store.
        """
        if not dist.is_initialized():
            world_size = env_world_size()
            if world_size > 1:
                raise ProcessGroupMissingError(world_size=world_size, rank=os.environ.get("RANK"))
            return cls.solo()
        world = dist.get_world_size(group)
        if world == 1:
            return cls.solo()
        store = store if store is not None else default_store()
        # Before any collective work: a rank that never comes is named, within the guard's timeout.
        members = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))
        roll_call(store, members=members, rank=dist.get_rank(group), timeout_s=timeout_s, name=name)
        if group is None or dist.get_backend(group) != "gloo":
            ranks = None if group is None else dist.get_process_group_ranks(group)
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
        return cls(rank=dist.get_rank(group), world=world, group=group, store=store, timeout_s=timeout_s, name=name)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def group(self) -> ProcessGroup | None:
        """The gloo process group the guard's collectives run on (None: world size 1)."""
        return cast("ProcessGroup | None", self._group)

    def close(self) -> None:
        """Stop the thread that publishes this rank's arrivals, and join it. Idempotent.

        Agreement still works after it (it needs no store), but a peer lost at a later
        guard is told this rank's state only from the last guard all ranks passed.
        """
        if self._publisher is None:
            return
        self._publisher.close()
        warn_each(self._publisher.take_errors())

    def share_run_id(self, given: str | None = None) -> str:
        """The run's id, the same on every rank: ``given``, else rank 0's, shared through the store.

        Collective when ``given`` is None and the world is larger than 1: every
        rank calls it, in the same order (the lifecycle does, when it is built).
        """
        if given:
            return given
        if self.world == 1:
            return new_run_id()
        key = f"{self.namespace}run"
        if self.rank == 0:
            self._store.set(key, new_run_id())
        return bytes(self._store.get(key)).decode()

    def agree(self, intent: Intent, *, state: str, timeout_s: float | None = None) -> None:
        """Return when every rank holds the same intent; raise a GuardError otherwise.

        ``timeout_s`` (at most the group's timeout) bounds this guard's wait
        instead of the group's own timeout.
        """
        publisher = self._publisher
        if publisher is None:  # world size 1
            return
        self._entries += 1
        arrival = record(intent.epoch, intent.trigger, state, "arrived")
        publisher.arm(arrival)
        key = intent.key
        self._view[0] = key
        self._view[1] = -key
        limit = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        started = time.monotonic()
        try:
            if limit < self.timeout_s:
                # A shorter wait than the group's own: the collective's wait bounds it.
                dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group, async_op=True).wait(
                    timedelta(seconds=limit)
                )
            else:
                dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group)
        except RuntimeError as exc:  # gloo reports timeouts and lost peers as RuntimeError
            publisher.disarm()
            # Make sure our own arrival is in the store before judging others'.
            try:
                publisher.set_now(arrival)
            except RuntimeError as store_exc:  # the store's host may be the lost peer: still name who is missing
                publisher.keep(self._last_key(self.rank), store_exc)
            error = self._missing_error(intent, exc, time.monotonic() - started, limit)
            note_on(error, publisher.take_errors())  # the store's records of us may be stale: say why
            raise error from exc
        publisher.disarm()
        if kept := publisher.take_errors():  # a store error fails no guard that agreed: it is reported
            warn_each(kept)
        if self._view[0] != -self._view[1]:
            raise self._divergence(intent)
        # What every rank agreed on last for this trigger: the evidence of who changed, next time.
        self._agreed[intent.trigger] = intent
        self._last_passed = LastSeen(
            rank=-1, epoch=intent.epoch, trigger=intent.trigger, state=state, phase=_PASSED, wall=time.time()
        )

    def share_outcome(self, error: BaseException | None, *, epoch: int, trigger: str, step: str) -> None:
        """Every rank learns whether a step that some ranks ran for all of them succeeded. Collective.

        A rank whose step failed re-raises its own error; the others raise
        ``PeerStepFailedError`` naming it, so every rank commits or fails
        together instead of waiting at the next guard for a rank that stopped.
        """
        if self.world == 1:
            if error is not None:
                raise error
            return
        flag = torch.tensor([0 if error is not None else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        if int(flag[0]) == 1:
            return
        said: list[Any] = [None] * self.world
        mine = None if error is None else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        dist.all_gather_object(said, mine, group=self._group)
        if error is not None:
            raise error
        failed = {r: text for r, text in enumerate(said) if text is not None}
        raise PeerStepFailedError(epoch=epoch, trigger=trigger, step=step, ranks=sorted(failed), errors=failed)

    def publish_failure(self, intent_epoch: int, trigger: str, state: str, phase: str | None = None, *,
                        step: str | None = None, error: str | None = None) -> None:  # fmt: skip
        """Tell the store that this rank failed, so that every peer waiting for it names it, with the
        step it failed in (None: its guard) and its exception's type, instead of calling it missing.
        ``phase``: what peers are shown of it, if not ``failed in <step, or guard> of`` (a failure
        outside the lifecycle's transitions, such as the demo's, names its own place)."""
        if self._publisher is not None:
            self._publisher.set_now(record(intent_epoch, trigger, state, "failed", step=step, error=error, phase=phase))

    def publish_recovered(self, epoch: int, trigger: str, state: str) -> None:
        """Tell the store that this rank left its failed state, so that no peer blames that failure later."""
        if self._publisher is not None:
            self._publisher.set_now(record(epoch, trigger, state, "recovered"))

    def last_seen(self) -> dict[int, LastSeen | None]:
        """What the store last heard from each rank (None: nothing, or store unreachable)."""
        return {r: None if s is None else s.seen for r, s in self._sightings().items()}

    def failures(self) -> dict[int, LastSeen]:
        """The ranks whose last word in the store is that they failed, with what they said."""
        return {r: s.seen for r, s in self._sightings().items() if s is not None and s.status == "failed"}

    def _sightings(self) -> dict[int, Sighting | None]:
        """``last_seen``, with what each rank's record says it did.

        One ``check`` and one ``multi_get`` for all ranks (two round trips,
        whatever the world size), not two per rank; key by key only while
        some rank has not even built its guard yet (a ``get`` would wait).
        """
        keys = [self._last_key(r) for r in range(self.world)]
        try:
            if self._store.check(keys):
                raws: list[bytes | None] = list(self._store.multi_get(keys))
            else:
                raws = [self._store.get(k) if self._store.check([k]) else None for k in keys]
        except RuntimeError:  # the store's host may be the rank that died
            return {r: None for r in range(self.world)}
        seen: dict[int, Sighting | None] = {}
        for r, raw in enumerate(raws):
            sighting = None if raw is None else read_record(orjson.loads(raw), rank=r)
            seen[r] = None if sighting is None or sighting.status == "joined" else sighting
        return seen

    def _last_key(self, rank: int) -> str:
        return f"{self.namespace}last/{rank}"

    def _arrived(self, intent: Intent, sighting: Sighting | None) -> bool:
        # A rank that failed in this very guard came to it: it fails with us, it is not the cause.
        return (
            sighting is not None
            and sighting.seen.epoch == intent.epoch
            and sighting.seen.trigger == intent.trigger
            and (sighting.status == "arrived" or (sighting.failed and sighting.seen.step is None))
        )

    def _missing_error(self, intent: Intent, exc: RuntimeError, waited: float, limit: float) -> Exception:
        timed_out = waited >= limit * 0.9 or "timed out" in str(exc).lower()
        missing, failed, seen = self._missing_report(intent, timed_out)
        last = {r: self._best_sighting(r, seen.get(r)) for r in missing}
        said = {r: s.seen for r in failed if (s := seen.get(r)) is not None}
        if said and not missing:
            # Nobody is missing: the ranks that failed on their own stopped this guard.
            return PeerFailedError(epoch=intent.epoch, trigger=intent.trigger, failed=said)
        if timed_out:
            return GuardTimeoutError(
                epoch=intent.epoch, trigger=intent.trigger, missing=missing, last_seen=last, timeout_s=limit,
                failed=said,
            )
        return PeerLostError(
            epoch=intent.epoch, trigger=intent.trigger, missing=missing, last_seen=last, cause=str(exc).splitlines()[0],
            failed=said,
        )

    def _missing_report(
        self, intent: Intent, timed_out: bool
    ) -> tuple[list[int], list[int], dict[int, Sighting | None]]:
        """Who is missing, who failed before the guard, and what the store last heard from both, as the
        reporter read it.

        The first survivor to ``add`` to the failure's claim key reads the store and
        publishes the report; the others spend one ``wait`` and one ``get`` on it
        instead of polling every rank's key. A survivor reads the store itself when
        no report comes in time (the reporter died) or the report names it (it came
        after the reporter read).
        """
        key = f"{self.namespace}report/{self._entries}/{intent.epoch}/{intent.trigger}"
        try:
            reporter = self._store.add(f"{key}/claim", 1) == 1
        except RuntimeError:  # the store's host is gone: reading it says so (every rank None)
            reporter = True
        if not reporter:
            report = self._wait_report(key)
            if report is not None and self.rank not in report[0]:
                return report
        missing, failed, seen = self._poll_missing(intent, timed_out)
        named = {r: seen[r] for r in (*missing, *failed)}
        if reporter:
            sightings = {r: None if s is None else s.body() for r, s in named.items()}
            body = {"missing": missing, "failed": failed, "seen": sightings}
            try:
                self._store.set(key, orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS))
            except RuntimeError as exc:  # the others' wait fails too, and they read the store themselves
                assert self._publisher is not None  # a guard of more than one rank has one
                self._publisher.keep(key, exc)
        return missing, failed, named

    def _wait_report(self, key: str) -> tuple[list[int], list[int], dict[int, Sighting | None]] | None:
        try:
            self._store.wait([key], timedelta(seconds=_REPORT_WAIT_S))
            body = orjson.loads(bytes(self._store.get(key)))
        except RuntimeError:  # no report in time (torch's DistStoreError is one), or the store is gone
            return None
        seen = {int(r): None if d is None else read_record(d) for r, d in body["seen"].items()}
        return list(body["missing"]), list(body["failed"]), seen

    def _poll_missing(
        self, intent: Intent, timed_out: bool
    ) -> tuple[list[int], list[int], dict[int, Sighting | None]]:
        deadline = time.monotonic() + (0.0 if timed_out else _ARRIVAL_GRACE_S)
        while True:
            seen = self._sightings()
            # This rank is here, whatever the store says (it may have refused our arrival).
            missing = [r for r in range(self.world) if r != self.rank and not self._arrived(intent, seen[r])]
            # Stop waiting once every rank that has not arrived has said it failed: none will come.
            if not missing or all(said_failed(seen[r]) for r in missing) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        # Ranks that published a failure are not missing: they stopped on their own, and are named as failed.
        return [r for r in missing if not said_failed(seen[r])], [r for r in missing if said_failed(seen[r])], seen

    def _best_sighting(self, rank: int, stored: Sighting | None) -> LastSeen | None:
        """The store's record if it is a failure; else the last guard all ranks passed together
        (a rank publishes its arrival only when it waits, so the store can be stale)."""
        if stored is not None and stored.failed:
            return stored.seen
        if self._last_passed is not None:
            p = self._last_passed
            return LastSeen(rank=rank, epoch=p.epoch, trigger=p.trigger, state=p.state, phase=p.phase, wall=p.wall)
        return None if stored is None else stored.seen

    def _divergence(self, intent: Intent) -> RankDivergenceError:
        """Explain a divergence with O(N) bytes: hashes of every field from every rank, then the
        whole intent only from one rank per distinct intent (not every rank's from every rank)."""
        fields = intent.fields()
        mine = torch.tensor([stable_hash(value) for _, value in fields], dtype=torch.int64)
        hashes = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(hashes, mine, group=self._group)
        rows = [tuple(h.tolist()) for h in hashes]
        representative = {row: rows.index(row) for row in dict.fromkeys(rows)}
        by_rep: dict[int, Intent] = {}
        for rep in representative.values():
            box: list[Intent | None] = [intent if rep == self.rank else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, rep), group=self._group)
            assert box[0] is not None  # the broadcast filled it with rank rep's intent
            by_rep[rep] = box[0]
        intents = [by_rep[representative[row]] for row in rows]
        return explain_divergence(intents, previous=self._agreed.get(intent.trigger))
