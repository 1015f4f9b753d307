"""``miles-fsm demo``: the whole colocated loop on the embedded default, on CPU.

N gloo ranks (``miles_fsm.launch.local.run_ranks``: the parent hosts the store and
always kills its children) each run K RL steps of the reference trainer and
engine through a ``Lifecycle`` (``rank``). Every cycle is verified bit-exact
(params and optimizer state against their pre-offload SHA256, engine weights
against the pushed ones).

``--inject KIND:RANK:STEP`` breaks one rank on purpose (``faults``); the run
must then end non-zero, quickly, naming that rank (``locate`` on the ranks,
``report`` in the parent).

Modules: ``config`` (DemoConfig, Injection), ``faults``, ``locate``,
``rank`` (the per-rank loop), ``events`` (the demo's trace events),
``progress`` (live, from the traces), ``report`` (DemoResult, blame, the
summary), ``run`` (``run_demo``), ``cli`` (``add_parser``).
"""

from __future__ import annotations

from miles_fsm.apps.demo.cli import add_parser
from miles_fsm.apps.demo.config import INJECTION_KINDS, DemoConfig, Injection
from miles_fsm.apps.demo.faults import demo_trainer_cls
from miles_fsm.apps.demo.report import DemoResult, print_result
from miles_fsm.apps.demo.run import run_demo

__all__ = [
    "INJECTION_KINDS",
    "DemoConfig",
    "DemoResult",
    "Injection",
    "add_parser",
    "demo_trainer_cls",
    "print_result",
    "run_demo",
]
