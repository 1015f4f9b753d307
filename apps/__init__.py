"""Applications built on the library: the ``miles-fsm`` command line, the demo, the bench entry.

This is the top layer. It may import the engine (``miles_fsm``), the
lifecycle (``miles_fsm.states``) and the drivers (``miles_fsm.drivers``);
nothing below imports it.
"""
