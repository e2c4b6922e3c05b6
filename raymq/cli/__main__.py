"""``python -m raymq.cli``: the ``raymq`` command."""

import sys

from raymq.cli import main

sys.exit(main())
