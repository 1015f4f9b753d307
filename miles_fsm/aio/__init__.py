"""The async API's engine: drive and await one rank's machine from anyio (asyncio or trio).

``machine`` runs each transition on a worker thread behind a per-rank FIFO
lock; ``gate`` holds a call's point of no return and the cancellation rules
around it; ``watch`` what watchers receive: state changes and snapshots.
"""

from miles_fsm.aio.machine import AsyncMachine, Drivable
from miles_fsm.aio.watch import AsyncSnapshot, MachineSnapshot, StateChange, StateChanges

__all__ = ["AsyncMachine", "AsyncSnapshot", "Drivable", "MachineSnapshot", "StateChange", "StateChanges"]
