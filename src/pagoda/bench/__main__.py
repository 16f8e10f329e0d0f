import sys

from pagoda.bench.cli import main

sys.exit(main())
