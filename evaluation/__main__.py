"""``python -m evaluation``: see `evaluation.cli`."""

import sys

from evaluation.cli import main

sys.exit(main())
