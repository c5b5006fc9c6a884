"""``python -m calibration ...``: see :mod:`calibration.cli`."""

import sys

from calibration.cli import main

sys.exit(main())
