"""Bindings of the lifecycle to real systems, and the protocols they implement."""

from miles_fsm.drivers.protocols import EngineDriver, StepReport, TrainerDriver

__all__ = ["EngineDriver", "StepReport", "TrainerDriver"]
