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

Under pytest-xdist (``make test`` runs two workers), one worker claims the scenarios
(a file created exclusively in a directory of the run's own) and runs them as above,
writing each outcome there (pickled); a module on another worker waits for its file.
The claiming worker, at its session's end, waits for the scenarios instead of killing
them: another worker may still need one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pickle
import subprocess
import threading
import time
from collections.abc import Callable

#: module (its file name) -> the scenario it runs; each returns what its fixture takes.
_SCENARIOS: dict[str, Callable[[], object]] = {}
_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_futures: dict[str, concurrent.futures.Future] = {}
_children: set[subprocess.Popen] = set()
_stopped = False  # the session ended: no child starts after stop_all
#: Modules whose scenario another xdist worker runs (their outcome comes in a file).
_elsewhere: set[str] = set()
#: Longest a worker waits for another's scenario (seconds): beyond the scenarios' time
#: limits added up (600 + 1,500 + 900 s), as they run one after another.
ELSEWHERE_SECONDS = 3600.0


#: The directory this run's xdist workers share (``start``'s ``shared``), or None.
_shared: str | None = None
#: True in the worker that runs the scenarios (under xdist).
_runner = False


def _claimed(shared: str) -> bool:
    """True for the one worker that runs the scenarios of this run (its pid is in the
    claim: a waiting worker stops waiting if that process is gone)."""
    try:
        fd = os.open(os.path.join(shared, "runner"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _runner_alive(shared: str) -> bool:
    """False once the worker that claimed the scenarios has ended (xdist replaces a
    crashed worker, and no one runs them then)."""
    try:
        with open(os.path.join(shared, "runner")) as f:
            pid = int(f.read() or 0)
    except (OSError, ValueError):
        return True  # (being written)
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _shared_by(fn: Callable[[], object], path: str) -> Callable[[], object]:
    """``fn``, its outcome (what it returned, or raised) also written to ``path``."""

    def run() -> object:
        try:
            result = ("returned", fn())
        except BaseException as exc:  # (pytest.fail and skip too: the waiter must know)
            result = ("raised", exc)
        try:
            data = pickle.dumps(result)
        except Exception as exc:  # an unpicklable error: its text
            data = pickle.dumps(("raised", RuntimeError(f"{result[1]!r} ({exc!r})")))
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.rename(path + ".tmp", path)  # whole or absent for the waiting worker
        if result[0] == "raised":
            raise result[1]
        return result[1]

    return run


def _wait_for_file(module: str, path: str) -> object:
    deadline = time.monotonic() + ELSEWHERE_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{module}'s scenario, run by another worker, never ended")
        if not _runner_alive(os.path.dirname(path)) and not os.path.exists(path):
            raise RuntimeError(f"the worker running {module}'s scenario ended before it did")
        time.sleep(0.5)  # polling for the other worker's file
    try:
        with open(path, "rb") as f:
            how, value = pickle.load(f)
    except Exception as exc:  # (an error that pickles but does not load)
        raise RuntimeError(f"{module}'s scenario outcome could not be read: {exc!r}") from None
    if how == "raised":
        raise value
    return value


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


def start(modules: list[str], shared: str | None = None) -> None:
    """Queue the scenarios of ``modules`` (file names, in the order the suite reaches
    them) on one background thread: one scenario at a time, so that they share the
    machine with the suite and not also with each other. ``shared``: a directory this
    run's xdist workers share (under xdist; the first worker to claim it runs them)."""
    global _pool, _shared, _runner
    wanted = [m for m in dict.fromkeys(modules) if m in _SCENARIOS and m not in _futures]
    if not wanted:
        return
    if shared is not None:
        _shared = shared
        os.makedirs(shared, exist_ok=True)
        _runner = _runner or _claimed(shared)
        if not _runner:
            _elsewhere.update(wanted)
            return
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scenario")
        for m in wanted:
            fn = _SCENARIOS[m] if shared is None else _shared_by(_SCENARIOS[m], _file(shared, m))
            _futures[m] = _pool.submit(fn)


def _file(shared: str, module: str) -> str:
    return os.path.join(shared, module + ".outcome")


def outcome(module: str) -> object:
    """What ``module``'s scenario returned (or raised), waiting for it; run here and now
    when it was not started in the background."""
    future = _futures.get(module)
    if future is not None:
        return future.result()
    if module in _elsewhere:
        return _wait_for_file(module, _file(_shared, module))
    return _SCENARIOS[module]()


def stop_all(interrupted: bool = False) -> None:
    """Kill the scenario children still running and drop the scenarios not started.
    Under xdist, unless ``interrupted``, wait for them instead: another worker may still
    wait for one (each child is bounded by its own time limit)."""
    global _stopped
    if _runner and not interrupted:
        concurrent.futures.wait(list(_futures.values()))
    with _lock:
        _stopped = True
        for future in _futures.values():
            future.cancel()
        for proc in _children:
            with contextlib.suppress(OSError):
                proc.kill()
    if _pool is not None:
        _pool.shutdown(wait=True)
