"""``python -m miles_fsm.apps.demo [flags]``: the same as ``miles-fsm demo [flags]``."""

import sys

from miles_fsm.apps.cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
