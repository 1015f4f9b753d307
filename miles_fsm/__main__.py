import sys

from miles_fsm.cli import main

sys.exit(main())
