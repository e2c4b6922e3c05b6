"""Shared helpers of the benchmark scripts: timing, tables and the disk's fdatasync rate."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from raymq.config import apply_ray_env_defaults

# Into a file or a pipe (a log, CI) Rich would assume 80 columns and crop wide tables.
console = Console(width=None if sys.stdout.isatty() else 140)
apply_ray_env_defaults()  # the benchmarks start Ray themselves, as RayMQ would


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def machine_cpu_seconds() -> float:
    """CPU seconds every process of the machine has used since boot (all cores)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    busy = sum(int(x) for x in fields[:8]) - int(fields[3]) - int(fields[4])  # not idle/iowait
    return busy / os.sysconf("SC_CLK_TCK")


def fill(q, messages: int, size: int, batch: int = 1000, properties=None, **send) -> float:
    """Store ``messages`` bodies of ``size`` bytes in ``q``, ``batch`` a send (each with
    ``properties`` and ``send_batch``'s keyword arguments ``send``), showing progress;
    returns the seconds it took."""
    from rich.progress import Progress

    body = b"x" * size
    t0 = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"filling {q.name}", total=messages)
        for _ in range(messages // batch):
            q.send_batch([body] * batch, properties, **send)
            progress.advance(task, batch)
    return time.perf_counter() - t0


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


def plasma_bytes() -> int:
    """Bytes in use in the object stores of the cluster (from Ray's memory summary)."""
    import re

    import ray
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    m = re.search(r"Plasma memory usage (\d+) MiB", text)
    return int(m.group(1)) * 2**20 if m else 0


class Sampler:
    """Samples, every ``interval`` seconds in a thread, whatever ``sample()`` returns
    (a dict of figures); ``samples`` keeps them all with their time."""

    def __init__(self, sample: Callable[[], dict], interval: float = 1.0):
        import threading

        self._sample = sample
        self.interval = interval
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while True:
            try:
                self.samples.append({"t": time.monotonic() - t0, **self._sample()})
            except Exception as exc:  # a sample failing must not end the run
                self.samples.append({"t": time.monotonic() - t0, "error": repr(exc)})
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def rss_of(pids: list[int]) -> int:
    """Total resident set size of the processes ``pids`` (bytes); gone ones count 0."""
    import psutil

    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total


#: The cluster a benchmark joins (``raymq bench NAME --address ...`` sets it). Unset, a
#: benchmark starts a Ray of its own even when a cluster runs on this machine or
#: ``RAY_ADDRESS`` names one: ``ray.init()`` without an address would join it, and a
#: benchmark would load a production broker by accident.
BENCH_ADDRESS_ENV = "RAYMQ_BENCH_ADDRESS"


def bench_ray_address() -> str:
    """``ray.init``'s address for a benchmark: ``$RAYMQ_BENCH_ADDRESS``, else ``"local"``
    (always a new local Ray; Ray ignores ``RAY_ADDRESS`` and ``ray_current_cluster`` then)."""
    return os.environ.get(BENCH_ADDRESS_ENV) or "local"


def start_broker(namespace: str, **settings):
    """Start a Ray of its own (or join ``$RAYMQ_BENCH_ADDRESS``) and a broker with its own
    temporary paging directory (under ``$RAYMQ_BENCH_DIR`` if set); returns the
    ``Broker``. ``stop_broker`` undoes it."""
    import ray

    import raymq

    address = bench_ray_address()
    own = {"include_dashboard": False} if address == "local" else {}
    ray.init(address=address, log_to_driver=False, configure_logging=False, **own)
    paging = tempfile.mkdtemp(prefix="raymq-bench-", dir=os.environ.get("RAYMQ_BENCH_DIR"))
    return raymq.connect(namespace=namespace, paging_directory=paging, **settings)


def stop_broker(broker) -> None:
    """Stop the broker and Ray, and delete the paging directory ``start_broker`` made."""
    import shutil

    import ray

    try:
        broker.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(broker.config.paging_directory, ignore_errors=True)
