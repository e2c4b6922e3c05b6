"""Helpers for tests of consumers on a real Ray: receiving an exact count, waiting for
what a queue does in the background, and a new consumer whose TargetList the queue does
not watch yet."""

from __future__ import annotations

import time

import ray
from raymq.placement import spares
from raymq.placement.nodes import current_node_id

#: Bound on waiting for a TargetList to load, in real seconds: only a wedge takes this long.
LOAD_SECONDS = 30.0
#: Bound on what a queue does in the background (moves, expiry, a restart), in real
#: seconds: a wedge fails, not a timing.
BACKGROUND_SECONDS = 120.0


def wait_for(condition, what: str) -> None:
    """Poll ``condition()`` until it holds (a figure the queue reports, changed by its
    background tasks); fails after ``BACKGROUND_SECONDS``."""
    deadline = time.monotonic() + BACKGROUND_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {BACKGROUND_SECONDS} s"
        time.sleep(0.05)


def receive_all(consumer, n: int) -> list:
    """Exactly ``n`` messages, by as many receives as it takes (30 s each at most)."""
    got = []
    while len(got) < n:
        more = consumer.receive(n - len(got), timeout=30)
        assert more, f"only {len(got)} of {n} messages came"
        got += more
    return got


def _put_off_the_watch(actor) -> None:
    """In a spare's process: its Ray registration waits for a first delivery."""
    # (Read by the TargetList's link when it puts the registration off.)
    import raymq.core.target_list_link as module

    module.WATCH_DELAY_SECONDS = 600.0


def unwatched_consumer(queue, loaded: int):
    """A consumer of ``queue`` (prefetch 10) whose TargetList puts off its Ray
    registration (the queue's death watch) until a first delivery, once it holds
    ``loaded`` messages."""
    assert spares.wait_warm(timeout=60)
    spare = spares._spares[spares._key(current_node_id())]
    ray.get(spare.__ray_call__.remote(_put_off_the_watch))
    consumer = queue.consumer(prefetch=10)
    assert consumer.target_list._actor_id == spare._actor_id
    deadline = time.monotonic() + LOAD_SECONDS
    while ray.get(consumer.target_list.__ray_call__.remote(_held)) < loaded:
        assert time.monotonic() < deadline, f"the TargetList never loaded {loaded} messages"
        time.sleep(0.05)
    return consumer


def _held(actor) -> int:
    return actor.targets.watermark
