"""Scenario processes that run beside the suite instead of in turn with it.

Three modules test a whole system in a child process with a Ray of its own (the README's
cluster path, a 4-node replication cluster, a chaos soak): together about 5 minutes on
2 cores, most of it waiting on processes starting and nodes dying, not on the CPU (the
replication scenario keeps the machine about a third busy). ``conftest.py`` starts
them, one at a time in the suite's order, as soon as the session knows it will run
them; each module's fixture then takes its scenario's outcome (``outcome``), waiting
if it is not over. A module run by itself starts its scenario when asked. Whatever is
still running when the session ends is killed.

Each scenario's assertions stay in its module; what runs in the background is only the
child process, with the same arguments, environment and time limit as before.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import subprocess
import threading
from collections.abc import Callable

#: module (its file name) -> the scenario it runs; each returns what its fixture takes.
_SCENARIOS: dict[str, Callable[[], object]] = {}
_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_futures: dict[str, concurrent.futures.Future] = {}
_children: set[subprocess.Popen] = set()
_stopped = False  # the session ended: no child starts after stop_all


def scenario(module: str) -> Callable[[Callable[[], object]], Callable[[], object]]:
    """Register ``fn`` as the scenario of test module ``module`` (e.g. "test_jobs.py")."""

    def register(fn: Callable[[], object]) -> Callable[[], object]:
        _SCENARIOS[module] = fn
        return fn

    return register


def run_child(argv: list[str], *, timeout: float, **popen) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)``, the child
    known to ``stop_all`` while it runs. Raises ``subprocess.TimeoutExpired`` (the child
    killed) past ``timeout`` seconds."""
    with _lock:
        if _stopped:  # a scenario between its start and its child when the session ended
            raise RuntimeError("the test session ended before this scenario's child started")
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
        )
        _children.add(proc)
    with proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        finally:
            with _lock:
                _children.discard(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def start(modules: list[str]) -> None:
    """Queue the scenarios of ``modules`` (file names, in the order the suite reaches
    them) on one background thread: one scenario at a time, so that they share the
    machine with the suite and not also with each other."""
    global _pool
    wanted = [m for m in dict.fromkeys(modules) if m in _SCENARIOS and m not in _futures]
    if not wanted:
        return
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scenario")
        for m in wanted:
            _futures[m] = _pool.submit(_SCENARIOS[m])


def outcome(module: str) -> object:
    """What ``module``'s scenario returned (or raised), waiting for it; run here and now
    when it was not started in the background."""
    future = _futures.get(module)
    if future is None:
        return _SCENARIOS[module]()
    return future.result()


def stop_all() -> None:
    """Kill the scenario children still running and drop the scenarios not started."""
    global _stopped
    with _lock:
        _stopped = True
        for future in _futures.values():
            future.cancel()
        for proc in _children:
            with contextlib.suppress(OSError):
                proc.kill()
    if _pool is not None:
        _pool.shutdown(wait=True)
