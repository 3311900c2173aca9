"""`python -m specserve ...`: the same program as the `specserve` console script."""

import sys

from .cli import main

sys.exit(main())
