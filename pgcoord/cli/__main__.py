"""``python -m pgcoord.cli``: the ``pgcoord`` command."""

import sys

from .main import main

sys.exit(main())
