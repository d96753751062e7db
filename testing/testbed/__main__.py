"""``python -m testbed``: the testbed's command line (testbed.cli)."""

import sys

from testbed.cli import main

sys.exit(main())
