"""``python -m kvfsm.cli``."""

import sys

from . import main

sys.exit(main())
