"""Shared helpers of the benchmark scripts: timing, tables and the disk's fdatasync rate."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

console = Console()


def timed(fn: Callable[[], int]) -> tuple[float, float]:
    """Run ``fn`` (which returns a message count); returns (seconds, messages per second)."""
    t0 = time.perf_counter()
    n = fn()
    dt = time.perf_counter() - t0
    return dt, n / dt


def fdatasync_bandwidth(total_bytes: int = 256 * 2**20, chunk: int = 2**20) -> float:
    """Sequential write with fdatasync after every ``chunk`` bytes; returns bytes/s."""
    data = os.urandom(chunk)
    with tempfile.NamedTemporaryFile(dir=os.environ.get("RAYMQ_BENCH_DIR")) as f:
        fd = f.fileno()
        t0 = time.perf_counter()
        for _ in range(total_bytes // chunk):
            os.write(fd, data)
            os.fdatasync(fd)
        return total_bytes / (time.perf_counter() - t0)


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """Print a rich table."""
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        table.add_row(*r)
    console.print(table)
