"""AckPipeline (raymq.acks) without Ray: gathering, linger, windows, errors."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import numpy as np
import pytest

from raymq.acks import AckPipeline
from raymq.errors import InvalidAck


class FakeQueue:
    """Records each ack call; answers them when told (or at once)."""

    def __init__(self, answer_at_once: bool = True):
        self.calls: list[np.ndarray] = []
        self.futures: list[cf.Future] = []
        self.answer_at_once = answer_at_once
        self.sent = threading.Event()

    def send(self, offsets: np.ndarray) -> cf.Future:
        fut: cf.Future = cf.Future()
        self.calls.append(np.asarray(offsets).copy())
        self.futures.append(fut)
        if self.answer_at_once:
            fut.set_result(len(offsets))
        self.sent.set()
        return fut


def check(fut: cf.Future, parts: list[np.ndarray]) -> None:
    fut.result()


def test_acks_gather_into_one_call_per_batch():
    q = FakeQueue()
    p = AckPipeline(q.send, check, batch_messages=10, linger_seconds=3600)
    for i in range(25):
        p.add_one(i)
    assert [len(c) for c in q.calls] == [10, 10]
    assert p.unsent == 5
    p.add(np.arange(100, 103))
    p.flush()
    assert [len(c) for c in q.calls] == [10, 10, 8]
    assert sorted(np.concatenate(q.calls).tolist()) == [*range(25), 100, 101, 102]
    assert p.unsent == 0 and p.in_flight == 0


def test_a_lingering_ack_is_sent_without_another_call():
    q = FakeQueue()
    p = AckPipeline(q.send, check, batch_messages=1000, linger_seconds=0.01)
    p.add_one(7)
    assert q.sent.wait(timeout=30), "the linger thread never sent the lone ack"
    assert [c.tolist() for c in q.calls] == [[7]]


def test_flush_waits_for_every_call_and_raises_the_first_error():
    q = FakeQueue(answer_at_once=False)
    p = AckPipeline(q.send, check, batch_messages=2, linger_seconds=3600)
    p.add(np.array([1, 2]))
    p.add(np.array([3, 4]))
    assert p.in_flight == 2
    q.futures[0].set_exception(InvalidAck("queue 'q': offset 1 not delivered"))
    threading.Timer(0.05, q.futures[1].set_result, (2,)).start()
    with pytest.raises(InvalidAck, match="offset 1"):
        p.flush()
    p.flush()  # the error was reported once; the second call had succeeded
    assert p.in_flight == 0


def test_a_full_window_waits_for_the_oldest_calls():
    q = FakeQueue(answer_at_once=False)
    p = AckPipeline(q.send, check, batch_messages=1, linger_seconds=3600, max_in_flight=2)
    p.add_one(0)
    p.add_one(1)
    assert p.in_flight == 2 and not any(f.done() for f in q.futures)
    answered = threading.Timer(0.05, lambda: [f.set_result(1) for f in q.futures[:2]])
    answered.start()
    p.add_one(2)  # a third call in flight: waits for the oldest
    assert q.futures[0].done()
    answered.join()


def test_a_send_that_raises_keeps_the_acks_for_the_next_send():
    q = FakeQueue()
    failing = [True]

    def send(offsets):
        if failing[0]:
            raise ConnectionError("no queue")
        return q.send(offsets)

    p = AckPipeline(send, check, batch_messages=1000, linger_seconds=3600)
    p.add_one(1)
    p.add(np.array([2, 3]))
    with pytest.raises(ConnectionError):
        p.send()
    assert p.unsent == 3
    failing[0] = False
    p.flush()
    assert sorted(np.concatenate(q.calls).tolist()) == [1, 2, 3]


def test_discard_returns_what_was_never_sent():
    q = FakeQueue()
    p = AckPipeline(q.send, check, batch_messages=1000, linger_seconds=3600)
    p.add_one(5)
    p.add(np.array([6]))
    assert sorted(np.concatenate(p.discard()).tolist()) == [5, 6]
    p.flush()
    assert q.calls == []


def test_finished_calls_do_not_pile_up_and_their_failure_is_raised_later():
    # The linger thread only sends; the consumer's sends check what finished, keeping
    # a failure for its next flush (it never vanishes, and nothing piles up).
    q = FakeQueue(answer_at_once=False)
    p = AckPipeline(q.send, check, batch_messages=1000, linger_seconds=3600)
    for i in range(100):
        p.add_one(i)
        p.send()  # as the linger thread would
        if i == 3:
            q.futures[-1].set_exception(InvalidAck(f"offset {i}"))
        else:
            q.futures[-1].set_result(1)
        p.collect(block=False, raise_errors=False)  # as the consumer's next fetch does
        assert p.in_flight == 0
    with pytest.raises(InvalidAck, match="offset 3"):
        p.flush()
    p.flush()
