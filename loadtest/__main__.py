"""`python -m loadtest ...`: the same as `pdserve loadtest ...`."""

import sys

from loadtest.cli import main

sys.exit(main())
