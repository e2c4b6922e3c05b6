"""Handles that outlive their Ray session (run by ``test_stale_handles_on_ray.py`` in a
child process with a Ray of its own): a queue, its consumer and the broker made in one
Ray session, used after ``ray.shutdown()`` and a new ``ray.init()``. Ray refuses to
submit a call to an actor of the old session with a bare ``Exception``; every call
must end in a typed RayMQ error at once. Prints one JSON line: what each call did."""

from __future__ import annotations

import json
import sys
import tempfile
import time

import ray

import raymq
from raymq.errors import RayMQError


def _ray() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)


def main() -> None:
    _ray()
    broker = raymq.connect(paging_directory=tempfile.mkdtemp(prefix="rmq-stale-"))
    queue = broker.create_queue("stale")
    queue.send(b"one")
    consumer = queue.consumer()
    received = consumer.receive(max_messages=1, timeout=30)
    assert [m.body for m in received] == [b"one"], received
    ray.shutdown()
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
    print(json.dumps(outcomes))
    sys.stdout.flush()
    ray.shutdown()


if __name__ == "__main__":
    main()
