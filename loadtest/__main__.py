"""`python -m loadtest`."""

import sys

from loadtest.cli import main

sys.exit(main())
