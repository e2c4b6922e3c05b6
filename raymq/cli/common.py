"""What every ``raymq`` command shares: byte sizes as options, printing (tables,
one-line messages, warnings) and joining the broker."""

from __future__ import annotations

import re
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from raymq._cli_ray import join_ray

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


class ByteSize(click.ParamType):
    """A size in bytes: ``1048576``, ``64MiB``, ``10MB``, ``1.5GiB``."""

    name = "bytes"

    def convert(self, value: Any, param, ctx) -> int:
        if isinstance(value, int):
            return value
        m = _SIZE.match(str(value))
        if not m:
            self.fail(f"{value!r} is not a size such as 1048576, 64MiB or 10MB", param, ctx)
        number, unit = float(m.group(1)), (m.group(2) or "").lower()
        base = 1024 if "i" in unit else 1000
        scale = _UNITS[unit[:1]] if base == 1000 else base ** "bkmgt".index(unit[:1] or "b")
        return int(number * scale)


BYTES = ByteSize()
console = Console()
#: Progress bars: on stderr, so that stdout carries only the command's output.
err_console = Console(stderr=True)
#: Columns of a table printed to a pipe or a file: wide enough that rows are whole
#: (Rich would fit them into 80 and cut queue names short).
PIPE_WIDTH = 200


def _print_table(table: Table) -> None:
    """Print a table: as wide as the terminal, or ``PIPE_WIDTH`` when not a terminal."""
    if console.is_terminal:
        console.print(table)
    else:
        Console(width=PIPE_WIDTH).print(table)


def _say(text: str, **style: Any) -> None:
    """Print one message on stdout, unwrapped (a pipe gets it as one line) and taken
    literally (a queue name or path with brackets is not Rich markup)."""
    console.print(text, soft_wrap=True, markup=False, highlight=False, **style)


def _warn(text: str) -> None:
    click.echo(f"raymq: warning: {text}", err=True)


def connect(ctx: click.Context, create: bool = False, **settings: Any):
    """Join Ray (quickly and quietly, see ``raymq._cli_ray``) and the broker.

    Every command connects through this one function (``common.connect``, looked up
    when called), so that a test can put a fake broker in its place."""
    import raymq

    join_ray(ctx.obj["address"], ctx.obj["namespace"], verbose=ctx.obj["verbose"])
    # warm=False: a command makes one consumer at most, then ends; a spare TargetList
    # started for it ahead would be a process (~0.5 s of CPU) mostly for nothing.
    return raymq.connect(
        address=ctx.obj["address"],
        namespace=ctx.obj["namespace"],
        create=create,
        warm=False,
        **settings,
    )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
