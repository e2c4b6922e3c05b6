"""Handles that outlive their Ray session (run by ``test_stale_handles_on_ray.py`` in a
child process with a Ray of its own): a queue, its consumer and the broker made in one
Ray session, used after ``ray.shutdown()`` and a new ``ray.init()``. Ray refuses to
submit a call to an actor of the old session with a bare ``Exception``; every call
must end in a typed RayMQ error at once. A spare TargetList whose creation was deferred
until after ``ray.shutdown()`` is not made (its ``.remote()`` would start a new Ray),
and no RayMQ thread dies of the shutdown. Prints one JSON line: what each call did."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time

import ray
from raymq.placement import spares

import raymq
from raymq.errors import RayMQError

#: Directories this run made (Ray's temp directories, the paging directory): removed at
#: its end. Under /tmp: Ray's socket paths inside them must stay short.
_made: list[str] = []


def _dir() -> str:
    _made.append(tempfile.mkdtemp(prefix="rmq-stale-"))
    return _made[-1]


def _ray() -> None:
    """A new local Ray of this process's own: ``address="local"`` (not a cluster found
    running, such as the jobs scenario's ``ray start`` beside the suite) and a temp
    directory of its own (where ``--address auto`` looks for the current cluster)."""
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _temp_dir=_dir(),
    )


def main() -> None:
    _ray()
    broker = raymq.connect(namespace="raymq-stale-session", paging_directory=_dir())
    queue = broker.create_queue("stale")
    queue.send(b"one")
    consumer = queue.consumer()
    received = consumer.receive(max_messages=1, timeout=30)
    assert [m.body for m in received] == [b"one"], received
    thread_errors: list[str] = []
    threading.excepthook = lambda args: thread_errors.append(
        f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}"
    )
    wanted = threading.Event()  # a spare for another node, deferred until this is set
    spares.warm("a-node-of-the-old-session", after=wanted)
    ray.shutdown()
    wanted.set()
    deadline = time.monotonic() + 60
    while spares._making and time.monotonic() < deadline:
        time.sleep(0.05)
    deferred = {"made_a_ray": ray.is_initialized(), "still_making": len(spares._making)}
    _ray()
    calls = {
        "send": lambda: queue.send(b"two"),
        "stats": queue.stats,
        "receive": lambda: consumer.receive(timeout=1),
        "ack": lambda: consumer.ack(received, wait=True),
        "create_queue": lambda: broker.create_queue("other"),
    }
    outcomes = {}
    for name, call in calls.items():
        started = time.monotonic()
        try:
            call()
            raised = None
        except Exception as exc:  # noqa: BLE001 - what was raised is the outcome
            raised = exc
        outcomes[name] = {
            "error": None if raised is None else type(raised).__name__,
            "typed": isinstance(raised, RayMQError),
            "message": str(raised)[:300],
            "seconds": time.monotonic() - started,
        }
    outcomes["deferred_spare"] = deferred
    outcomes["thread_errors"] = thread_errors
    print(json.dumps(outcomes))
    sys.stdout.flush()
    ray.shutdown()


if __name__ == "__main__":
    try:
        main()
    finally:
        for made in _made:
            shutil.rmtree(made, ignore_errors=True)
