"""``python -m prism_tda.cli``."""

import sys

from . import main

sys.exit(main())
