"""A consumer whose queue keeps failing its fetches gets a typed error from receive()
instead of nothing forever, and receives again once the queue is back (a real local Ray,
a real SIGKILL, and a queue actor that cannot start again because its files are gone).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from raymq.client.calls import _call
from raymq.errors import BrokerUnavailable

#: Bound on waiting for what must happen: only a wedge takes this long (seconds).
DEADLINE_SECONDS = 120.0


def receive_until_it_raises(consumer) -> tuple[list[bytes], BrokerUnavailable]:
    """Receive (the TargetList's buffer first) until receive() raises; returns the
    bodies received and the error. Fails the test if nothing is raised in time."""
    bodies: list[bytes] = []
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        try:
            bodies += [m.body for m in consumer.receive(10, timeout=1)]
        except BrokerUnavailable as exc:
            return bodies, exc
    pytest.fail(f"receive() returned nothing without an error for {DEADLINE_SECONDS} s")


def test_a_queue_that_cannot_restart_fails_receive_until_it_is_back(broker_factory, paging_dir):
    broker = broker_factory()  # its files are in paging_dir
    q = broker.create_queue("orders")
    q.send_batch([b"m%02d" % i for i in range(20)])
    directory = os.path.join(paging_dir, "orders")
    with q.consumer(prefetch=5) as consumer:
        first = consumer.receive(5, timeout=DEADLINE_SECONDS)
        assert [m.body for m in first] == [b"m%02d" % i for i in range(5)]
        consumer.ack(first, wait=True)  # durable before the kill
        # The queue's files go away (a disk not mounted again after a reboot, say): a
        # plain file stands where its directory was, so the queue actor that Ray starts
        # again after the kill fails in its constructor, and Ray gives up on it.
        os.rename(directory, directory + ".away")
        with open(directory, "w") as f:
            f.write("not the queue's directory")
        os.kill(_call(q._actor.pid), signal.SIGKILL)
        try:
            buffered, error = receive_until_it_raises(consumer)
            assert "'orders'" in str(error)
            # What the TargetList held came first; nothing was lost or made up.
            assert set(buffered) <= {b"m%02d" % i for i in range(5, 20)}
            with pytest.raises(BrokerUnavailable, match="'orders'"):
                consumer.receive(10, timeout=1)  # every receive, not only the first
        finally:
            os.remove(directory)
            os.rename(directory + ".away", directory)
        broker.get_queue("orders")  # the broker starts the queue again, from its files
        deadline = time.monotonic() + DEADLINE_SECONDS
        again: list[bytes] = []
        last_error = None
        while not again:  # the loader finds the new queue actor by its name
            assert time.monotonic() < deadline, f"receive() never worked again: {last_error}"
            try:
                again = [m.body for m in consumer.receive(10, timeout=1)]
            except BrokerUnavailable as exc:
                last_error = exc
                time.sleep(0.2)  # until the loader's next fetch succeeds
        # Unacknowledged messages are delivered again, from the files.
        assert set(again) <= {b"m%02d" % i for i in range(5, 20)}
        assert not consumer.stats()["loader_error_persistent"]


def test_a_consumer_whose_target_list_died_gets_an_error_naming_its_queue(broker):
    """Its TargetList actor killed for good (its node lost, say): receive raises
    ``BrokerUnavailable`` naming the queue and the consumer, not only "actor
    unavailable"."""
    import ray

    q = broker.create_queue("orphaned")
    q.send(b"one")
    c = q.consumer(prefetch=1)
    try:
        assert [m.body for m in c.receive(1, timeout=30)] == [b"one"]
        ray.kill(c.target_list, no_restart=True)
        _, error = receive_until_it_raises(c)
        assert f"queue 'orphaned': consumer {c.consumer_id[:8]}" in str(error), error
    finally:
        c.close()
