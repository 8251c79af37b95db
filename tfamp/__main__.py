"""``python -m tfamp`` runs the command line."""

import sys

from tfamp.cli import main

sys.exit(main())
