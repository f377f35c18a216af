"""`python -m swarmpipe`: the same as the `swarmpipe` command."""

import sys

from swarmpipe.cli import main

sys.exit(main())
