"""`python -m pagoda.calc ...`: the same as `pagoda calc ...`."""

import sys

from pagoda.calc.cli import main

sys.exit(main())
