"""``python -m benchmarks.h100_program``: runs the command line (``cli.main``)."""

import sys

from benchmarks.h100_program.cli import main

sys.exit(main())
