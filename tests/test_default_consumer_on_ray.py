"""The consume path with default settings, on a real Ray: pipelined acks (what a crash
before they are sent means), a handle reading its own acks, ``for message in
consumer``, and ``Message`` as delivered."""

from __future__ import annotations

import os
import signal

import ray


def fill(q, n: int) -> None:
    q.send_batch([f"m{i}".encode() for i in range(n)], {"k": "v"})


@ray.remote(num_cpus=0)
class AckingProcess:
    """A separate worker process that acks with the default (pipelined) ack, whose acks
    never leave it: nothing sends them before it is killed."""

    def __init__(self, namespace: str, queue: str):
        import raymq
        import raymq.acks

        raymq.acks.ACK_LINGER_SECONDS = 3600.0  # no linger send before the kill
        self.c = raymq.connect(namespace=namespace).get_queue(queue).consumer()
        assert self.c._acks.linger_seconds == 3600.0

    def receive_and_ack(self, n: int) -> list[int]:
        got = []
        while len(got) < n:
            msgs = self.c.receive(n - len(got), timeout=10)
            self.c.ack(msgs)  # pipelined: returns at once
            got += [m.offset for m in msgs]
        assert self.c._acks.unsent == n  # gathered, not sent
        return got

    def pid(self) -> int:
        return os.getpid()


def test_a_crash_between_a_pipelined_ack_and_its_flush_redelivers(broker):
    q = broker.create_queue("crash-acks")
    fill(q, 20)
    worker = AckingProcess.remote(broker.namespace, "crash-acks")
    acked = ray.get(worker.receive_and_ack.remote(20))
    assert sorted(acked) == list(range(20))
    os.kill(ray.get(worker.pid.remote()), signal.SIGKILL)
    with q.consumer() as c:
        got = {}
        while len(got) < 20:
            msgs = c.receive(20, timeout=30)
            assert msgs, f"only {len(got)} of 20 came back"
            got.update((m.offset, m.delivery_count) for m in msgs)
        c.ack(list(got), wait=True)
    assert got == {o: 2 for o in range(20)}  # each delivered again, none lost
    assert q.stats()["depth"] == 0


def test_default_acks_are_pipelined_and_the_handle_reads_its_own(broker):
    q = broker.create_queue("own-acks")
    fill(q, 50)
    with q.consumer() as c:
        msgs = c.receive(max_messages=50, timeout=10)
        assert len(msgs) == 50
        assert c.ack(msgs[:30]) is None  # pipelined
        assert q.stats()["depth"] == 20  # stats() sent and waited for them first
        assert c.ack(msgs[30:], wait=True) == 20  # durable, counted
    assert q.stats()["depth"] == 0


def test_iterating_a_consumer_yields_every_message_in_order(broker):
    q = broker.create_queue("iterate")
    fill(q, 300)
    with q.consumer() as c:
        seen = []
        for message in c:
            assert message.body == f"m{message.offset}".encode()
            assert message.properties == {"k": "v"} and message.delivery_count == 1
            c.ack(message)
            seen.append(message.offset)
            if len(seen) == 100:
                break  # leaves the loop mid-chunk: the rest stay this consumer's
        rest = c.receive(max_messages=300, timeout=10)
        assert [m.offset for m in rest][:1] == [100]  # the next one, not skipped
        while len(rest) < 200:
            more = c.receive(max_messages=300, timeout=10)
            assert more, f"only {len(rest)} of the other 200 came"
            rest += more
        assert [m.offset for m in rest] == list(range(100, 300))
        assert all(m.delivery_count == 1 for m in rest)  # handed back, not redelivered
        c.ack(rest)
        c.flush()
    assert seen == list(range(100))
    assert q.stats()["depth"] == 0


def test_iteration_ends_when_the_consumer_closes(broker):
    q = broker.create_queue("iterate-close")
    fill(q, 3)
    c = q.consumer()
    seen = []
    for message in c:
        seen.append(message.offset)
        c.ack(message)
        if len(seen) == 3:
            c.close()  # flushes the acks; the loop then ends
    assert seen == [0, 1, 2]
    assert q.stats()["depth"] == 0
