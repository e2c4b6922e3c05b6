"""``python -m raymq.cli``: the ``raymq`` command."""

from raymq.cli import run

run()
