"""``python -m tests.progen --count N --seed S``: the long mode (see ``longrun``)."""

import sys

from tests.progen.longrun import main

sys.exit(main())
