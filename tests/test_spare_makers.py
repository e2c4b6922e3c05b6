"""The threads that make spare TargetLists (``placement.spares._Makers``), without Ray:
reused when idle, one more for each creation that waits while another does, daemons."""

from __future__ import annotations

import threading

from raymq.placement.spares import _Makers

#: Bound on a wait that must end, in real seconds: only a wedge takes this long.
WAIT_SECONDS = 30.0


def run_one(makers: _Makers) -> str:
    """Submit a job and wait for it; the name of the thread that ran it."""
    ran = threading.Event()
    who: list[threading.Thread] = []

    def job() -> None:
        who.append(threading.current_thread())
        ran.set()

    makers.submit(job)
    assert ran.wait(WAIT_SECONDS)
    return who[0]


def wait_idle(makers: _Makers, n: int) -> None:
    """Until ``n`` threads are idle (a job's thread counts itself idle after it)."""
    done = threading.Event()
    for _ in range(int(WAIT_SECONDS * 1000)):
        with makers._lock:
            if makers._idle == n:
                done.set()
                break
        done.wait(0.001)
    assert done.is_set(), f"idle {makers._idle}, not {n}"


def test_jobs_one_after_another_reuse_one_daemon_thread():
    makers = _Makers()
    first = run_one(makers)
    wait_idle(makers, 1)
    second = run_one(makers)
    assert first is second and first.daemon and first.name == "raymq-spare"


def test_a_job_submitted_while_another_waits_gets_a_thread_of_its_own():
    makers = _Makers()
    release = threading.Event()
    started = threading.Event()

    def waiting() -> None:  # as a creation that waits for its consumer's first answer
        started.set()
        release.wait(WAIT_SECONDS)

    makers.submit(waiting)
    assert started.wait(WAIT_SECONDS)
    other = run_one(makers)  # not held behind the waiting one
    assert other.name == "raymq-spare"
    release.set()
    wait_idle(makers, 2)


def test_a_failing_job_leaves_its_thread_for_the_next(caplog):
    makers = _Makers()

    def failing() -> None:
        raise RuntimeError("no Ray")

    makers.submit(failing)
    wait_idle(makers, 1)
    assert "creation failed" in caplog.text
    run_one(makers)
    wait_idle(makers, 1)
