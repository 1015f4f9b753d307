"""``python -m miles_fsm``: the command line, which lives in the apps layer above the engine."""

import importlib
import sys

# By name, not by import statement: the engine package never imports the layers above it.
sys.exit(importlib.import_module("miles_fsm.apps.cli").main())
