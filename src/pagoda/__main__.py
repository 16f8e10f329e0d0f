import sys

from pagoda.cli import main

sys.exit(main())
