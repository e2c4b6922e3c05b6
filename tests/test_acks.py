"""AckPipeline (raymq.client.acks) without Ray: gathering, linger, windows, errors, bounded
waits; and the Consumer's client-side logic (its buffer, close from another thread,
async receives, received lists) with a fake TargetList."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import pickle
import threading
import time
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from raymq.batch import EMPTY_DELIVERY
from raymq.client import Consumer, Message, Messages
from raymq.client.acks import AckPipeline
from raymq.client.consumer import TRICKLE_ACKS
from raymq.client.consumer_acks import ConsumerAcks
from raymq.errors import BrokerUnavailable, ConsumerClosed, InvalidAck, NotLeader
from raymq.wire.errors import WireBroken
from raymq.wire.send import MAX_ACK_OFFSETS


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


class Stalled(cf.Future):
    """A call the queue never answers (until the test does): ``waiting`` is set once
    someone waits for its result."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def result(self, timeout=None):
        self.waiting.set()
        return super().result(timeout)


def test_a_consumer_whose_queue_does_not_answer_delays_no_other_consumers_acks():
    stalled = Stalled()
    stuck = AckPipeline(lambda offsets: stalled, check, batch_messages=1000, linger_seconds=0.01)
    stuck.add(np.array([1]))
    stuck.send()
    # Its consumer waits for that answer, holding its pipeline.
    flushing = threading.Thread(target=stuck.flush, kwargs={"timeout": 60}, daemon=True)
    flushing.start()
    assert stalled.waiting.wait(timeout=30)
    fine = FakeQueue()
    other = AckPipeline(fine.send, check, batch_messages=1000, linger_seconds=0.01)

    def ack_both() -> None:
        stuck.add_one(2)  # lingers first: the linger thread meets the held pipeline
        other.add_one(7)

    threading.Thread(target=ack_both, daemon=True).start()
    try:
        assert fine.sent.wait(timeout=30), "one stuck queue stalled another consumer's acks"
        assert [c.tolist() for c in fine.calls] == [[7]]
    finally:
        stalled.set_result(1)
        flushing.join(timeout=30)
    stuck.flush()  # the offset gathered meanwhile is sent once the pipeline is free
    assert stuck.unsent == 0


def test_flush_is_bounded_and_close_can_count_what_stayed_unanswered():
    q = FakeQueue(answer_at_once=False)
    p = AckPipeline(q.send, check, batch_messages=2, linger_seconds=3600)
    p.add(np.array([1, 2]))
    p.add_one(3)
    assert p.flush(timeout=0.01) == 2  # neither call answered: reported, not waited out
    assert p.in_flight == 2 and p.unsent == 0
    q.futures[0].set_result(2)
    assert p.flush(timeout=0.01) == 1  # the first checked; the second still in flight
    assert sorted(np.concatenate(p.abandon()).tolist()) == [3]
    assert p.in_flight == 0 and p.flush(timeout=0.01) == 0


def test_a_full_window_raises_broker_unavailable_naming_the_queue_when_unanswered():
    q = FakeQueue(answer_at_once=False)
    p = AckPipeline(
        q.send, check, 1, linger_seconds=3600, max_in_flight=1, what="queue 'q'", answer_seconds=0
    )
    p.add_one(0)
    with pytest.raises(BrokerUnavailable, match="queue 'q'"):
        p.add_one(1)  # a second call in flight: waits for the first, which never answers
    assert p.in_flight == 2  # nothing forgotten: a later flush checks both


def test_acks_added_from_many_threads_are_all_sent_once():
    q = FakeQueue()
    p = AckPipeline(q.send, check, batch_messages=97, linger_seconds=0.001)

    def add(first: int) -> None:
        for i in range(first, first + 5000):
            p.add_one(i)

    threads = [threading.Thread(target=add, args=(k * 5000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    p.flush()
    sent = np.concatenate(q.calls)
    assert len(sent) == 20_000 and sorted(sent.tolist()) == list(range(20_000))


# -- the Consumer's client-side logic, without Ray -------------------------------------


def delivery(first: int, n: int) -> pa.RecordBatch:
    rows = [
        {
            "offset": first + i,
            "timestamp": 1_700_000_000_000_000 + i,
            "delivery_count": 1,
            "body": b"m%d" % (first + i),
            "properties": b"",
        }
        for i in range(n)
    ]
    return pa.RecordBatch.from_pylist(rows, schema=EMPTY_DELIVERY.schema)


def fake_consumer(take_batch) -> Consumer:
    """A Consumer whose TargetList is ``take_batch(wait, want)`` (no Ray)."""
    c = Consumer.__new__(Consumer)
    c.queue = SimpleNamespace(name="q", _actor=None)
    c.consumer_id, c.prefetch, c._subscription = "c1", 1000, None
    c._buffer, c._buffer_lock, c._closed = None, threading.Lock(), False
    c._acks = AckPipeline(FakeQueue().send, check, 500, linger_seconds=3600, what="queue 'q'")
    c._ack_singles = c._acks._singles
    c.acks_lost = c.close_failures = c.delivery_channel_failures = c.delivery_channel_unread = 0
    c._channel, c._receiver, c._async_takes, c._async_settled = None, None, 0, None
    c._first_answer = threading.Event()
    c._take_batch = take_batch
    return c


def held_consumer() -> tuple[Consumer, threading.Event, threading.Event]:
    """A fake consumer whose first fetch (offsets 0..19) waits for ``release``;
    ``entered`` tells it started. Returns (consumer, entered, release)."""
    entered, release = threading.Event(), threading.Event()
    batches = [delivery(0, 20)]

    def take_batch(wait: float, want: int = 1):
        entered.set()
        assert release.wait(timeout=30)
        return batches.pop(0) if batches else None

    return fake_consumer(take_batch), entered, release


async def receive_the_rest(c: Consumer, got: list[int]) -> list[int]:
    """``got`` and the offsets received after it, until 20 came (5 a receive)."""
    while len(got) < 20:
        msgs = await c.receive_async(5, timeout=0.5)
        assert msgs, f"only {got} came back"
        got += [m.offset for m in msgs]
    return got


def test_a_receive_sends_the_acks_first_only_when_the_target_list_needs_their_credit():
    """A receive that waits sends the acks gathered before it only from
    ``TRICKLE_ACKS`` on (under a trickle of the prefetch); fewer go after their
    linger, not as an ack frame and fsync of their own for each receive."""
    sent_before_take: list[int] = []
    offsets = iter(range(1_000))

    def take_batch(wait: float, want: int = 1):
        sent_before_take.append(sum(len(call) for call in fake.calls))
        return delivery(next(offsets), 1)

    c = fake_consumer(take_batch)
    fake = c._acks._send_call.__self__
    trickle = min(c.prefetch // 4, TRICKLE_ACKS)
    for _ in range(trickle + 2):
        c.ack(c.receive(1, timeout=5), wait=False)
    assert sent_before_take[:trickle] == [0] * trickle
    assert sent_before_take[trickle] == trickle  # sent before that wait, in one call
    assert [call.tolist() for call in fake.calls] == [list(range(trickle))]
    c._acks.flush()
    assert sorted(np.concatenate(fake.calls).tolist()) == list(range(trickle + 2))


def test_a_cancelled_async_receive_loses_and_reorders_nothing():
    c, entered, release = held_consumer()

    async def main() -> list[int]:
        first = asyncio.ensure_future(c.receive_async(10, timeout=5))
        await asyncio.to_thread(entered.wait, 30)
        first.cancel()
        release.set()  # the take finishes after its caller was cancelled
        with contextlib.suppress(asyncio.CancelledError):
            await first
        return await receive_the_rest(c, [])

    assert asyncio.run(asyncio.wait_for(main(), 60)) == list(range(20))
    c._receiver.shutdown(wait=True)


def test_a_receive_started_before_a_cancelled_one_settles_waits_for_its_rows():
    """The caller cancels a receive whose take already finished in the receive thread,
    and receives again before the cancel is handled: the new take waits until the
    cancelled one's rows are back in front of the buffer (it does not slice 10..14)."""
    c, entered, release = held_consumer()
    taken = threading.Event()
    take = c._take

    def take_then_tell(max_messages, timeout):
        try:
            return take(max_messages, timeout)
        finally:
            taken.set()

    c._take = take_then_tell

    async def main() -> list[int]:
        first = asyncio.ensure_future(c.receive_async(10, timeout=5))
        await asyncio.to_thread(entered.wait, 30)
        release.set()
        assert taken.wait(30)  # done in the receive thread; its caller not resumed yet
        # The loop's thread stalls before it handles the cancel (as if preempted): the
        # receive thread runs the next take meanwhile. Not a synchronisation: the
        # take must come out right however long the stall.
        asyncio.get_running_loop().call_soon(time.sleep, 0.2)
        first.cancel()
        got = [m.offset for m in await c.receive_async(5, timeout=5)]
        with contextlib.suppress(asyncio.CancelledError):
            await first
        return await receive_the_rest(c, got)

    assert asyncio.run(asyncio.wait_for(main(), 60)) == list(range(20))
    c._receiver.shutdown(wait=True)


def test_a_receive_waiting_in_another_thread_ends_when_the_consumer_closes():
    def take_batch(wait: float, want: int = 1):
        return None  # nothing arrives: the receive waits on, a second at a time

    c = fake_consumer(take_batch)
    outcome: list[BaseException | list] = []

    def receive() -> None:
        try:
            outcome.append(c.receive(10, timeout=None))
        except ConsumerClosed as exc:
            outcome.append(exc)

    def iterate() -> None:
        outcome.append(list(c))

    threads = [threading.Thread(target=receive), threading.Thread(target=iterate)]
    for t in threads:
        t.start()
    c._closed = True  # what close() does first (its Ray part is tested on Ray)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a receive went on after close"
    assert sorted(map(repr, outcome)) == sorted([repr([]), repr(c._closed_error())])


def test_received_messages_read_as_a_list_and_ack_as_one_array():
    sent = FakeQueue()
    c = fake_consumer(lambda wait, want=1: delivery(0, 10))
    c._acks = AckPipeline(sent.send, check, 500, linger_seconds=3600)
    c._ack_singles = c._acks._singles
    msgs = c.receive(10, timeout=1)
    as_list = [Message(i, b"m%d" % i, 1, 1_700_000_000 + i / 1e6, b"") for i in range(10)]
    assert len(msgs) == 10 and msgs == as_list and list(msgs) == as_list
    assert msgs[3] == as_list[3] and msgs[-1] == as_list[-1] and msgs[::3] == as_list[::3]
    assert msgs[2:5] == as_list[2:5] and msgs[2:5].offsets.tolist() == [2, 3, 4]
    assert msgs + as_list[:1] == as_list + as_list[:1]
    assert as_list[:1] + msgs == as_list[:1] + as_list
    got: list = []
    got += msgs
    assert got == as_list and as_list[4] in msgs
    assert pickle.loads(pickle.dumps(msgs)) == as_list
    with pytest.raises(IndexError):
        msgs[10]
    c.ack(msgs[:2])  # the column of a slice: one array
    c.ack(msgs[2:])
    c._acks.flush()
    assert [call.tolist() for call in sent.calls] == [list(range(10))]
    assert Messages() == [] and not Messages() and Messages().offsets.tolist() == []


def test_close_always_kills_the_target_list_whatever_giving_back_raised(monkeypatch):
    import ray

    class Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args):
            return self.name

    c = fake_consumer(lambda wait, want=1: None)
    c.target_list = SimpleNamespace(close=Method("target list close"))
    c.queue._actor = SimpleNamespace(close_consumer=Method("queue close_consumer"))
    asked, killed = [], []

    def get(ref, timeout=None):
        asked.append(ref)
        raise RuntimeError(f"a bug in {ref}")  # not a RayMQError

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor))
    c.close()
    assert asked == ["target list close", "queue close_consumer"]
    assert killed == [c.target_list] and c.close_failures == 1 and c._closed


def test_acks_of_a_call_that_did_not_reach_the_queue_are_sent_again():
    """Issue 28, Observed 4: a pipelined ack call that failed because the queue's
    actor is gone is sent again (to the queue's current actor), not counted lost: else
    the consumer stalls at its prefetch with those messages held."""
    q = FakeQueue(answer_at_once=False)
    failures = {"left": 2}

    def resend_on_failure(fut: cf.Future, parts: list[np.ndarray]) -> None:
        try:
            fut.result()
        except BrokerUnavailable:
            p.requeue(parts)

    p = AckPipeline(q.send, resend_on_failure, batch_messages=3, linger_seconds=3600)

    flushed = threading.Event()

    def answer():
        # The first two calls fail as a dead actor's would; every later one is stored.
        # Answering until the flush returned: a call made after three were answered
        # must be answered too (an answerer that left then made the flush wait its 30 s
        # out, once in about 30 runs; a resend more than asked for is harmless).
        while not flushed.is_set():
            for fut in list(q.futures):
                if not fut.done():
                    if failures["left"]:
                        failures["left"] -= 1
                        fut.set_exception(BrokerUnavailable("queue 'q': actor died"))
                    else:
                        fut.set_result(3)
            flushed.wait(0.005)

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    p.add(np.array([1, 2, 3]))
    try:
        assert p.flush(timeout=30) == 0
    finally:
        flushed.set()
        answering.join(timeout=30)
    calls = [c.tolist() for c in q.calls]
    assert len(calls) >= 3 and all(c == [1, 2, 3] for c in calls)  # sent again, twice+
    assert p.unsent == 0 and p.in_flight == 0


class WaitedChannel:
    """A SendChannel's ``consumer_call``: answers how many, or raises ``error``."""

    def __init__(self, error: BaseException | None = None, ops=("ack", "nack", "reject")):
        self.error = error
        self.ops = ops
        self.calls: list[tuple] = []

    def serves(self, op: str) -> bool:
        return op in self.ops

    def consumer_call(self, op, consumer_id, offsets, subscription, *more) -> int:
        self.calls.append((op, consumer_id, offsets.tolist(), subscription, *more))
        if self.error is not None:
            raise self.error
        return len(offsets)


class WaitedQueue:
    """A queue handle: its open SendChannel (or None) and its Ray calls' answer."""

    name = "q"

    def __init__(self, channel: WaitedChannel | None, ray_answer: object = 5):
        self.channel = channel
        self.ray_answer = ray_answer
        self.ray_calls: list[tuple] = []

    def _ack_channel(self) -> WaitedChannel | None:
        return self.channel

    def _invoke(self, op, consumer_id, offsets, subscription, *more):
        self.ray_calls.append((op, consumer_id, offsets.tolist(), subscription, *more))
        if isinstance(self.ray_answer, BaseException):
            raise self.ray_answer
        return self.ray_answer


def waited(channel: WaitedChannel | None, ray_answer: object = 5) -> ConsumerAcks:
    """A consumer's acks (the mixin alone) over ``channel``, Ray answering ``ray_answer``."""
    settle = ConsumerAcks()
    settle.queue = WaitedQueue(channel, ray_answer)  # type: ignore[assignment]
    settle.consumer_id, settle._subscription = "c", "s"
    settle.calls_over_wire = settle.calls_in_doubt = 0
    return settle


def broken(pending: bool) -> WireBroken:
    exc = WireBroken("queue 'q': connection lost")
    exc.answer_pending = pending
    return exc


def test_waited_acks_nacks_and_rejects_go_over_an_open_channel_else_through_ray():
    offsets = np.array([3, 4], dtype=np.int64)
    settle = waited(WaitedChannel())
    assert settle._waited_call("nack", offsets, 1.5) == 2
    assert settle._waited_call("reject", offsets) == 2
    assert settle.queue.channel.calls == [
        ("nack", "c", [3, 4], "s", 1.5),
        ("reject", "c", [3, 4], "s"),
    ]
    assert settle.queue.ray_calls == [] and settle.calls_over_wire == 2

    settle = waited(None)  # no channel open (yet): Ray
    assert settle._waited_call("ack", offsets) == 5
    assert settle.queue.ray_calls == [("ack", "c", [3, 4], "s")] and settle.calls_over_wire == 0

    settle = waited(WaitedChannel(ops=("ack",)))  # an older queue actor: no nack op
    assert settle._waited_call("nack", offsets, None) == 5
    assert settle.queue.channel.calls == [] and len(settle.queue.ray_calls) == 1

    settle = waited(WaitedChannel())  # more offsets than a frame carries: Ray
    assert settle._waited_call("ack", np.arange(MAX_ACK_OFFSETS + 1)) == 5
    assert settle.queue.channel.calls == [] and len(settle.queue.ray_calls) == 1


@pytest.mark.parametrize("refusal", [broken(False), NotLeader("queue 'q' hibernates")])
def test_a_waited_call_the_channel_did_not_carry_goes_through_ray_and_raises_its_refusal(refusal):
    """Known broken before it was written, or refused unread (``NotLeader``): Ray carries
    it, and the queue's refusal there is the application's to see."""
    settle = waited(WaitedChannel(refusal), ray_answer=InvalidAck("queue 'q': never held 3"))
    with pytest.raises(InvalidAck, match="never held 3"):
        settle._waited_call("nack", np.array([3]), None)
    assert settle.queue.ray_calls == [("nack", "c", [3], "s", None)]
    assert settle.calls_in_doubt == 0


def test_a_waited_call_lost_with_its_connection_and_refused_through_ray_counts_as_done():
    """Written before the connection broke: the queue may have done it then, so a
    refusal of the same call through Ray is not the application's error (answered 0,
    counted); another answer through Ray is returned as it is."""
    settle = waited(WaitedChannel(broken(True)), ray_answer=InvalidAck("never held 3"))
    assert settle._waited_call("reject", np.array([3])) == 0
    assert settle.calls_in_doubt == 1 and len(settle.queue.ray_calls) == 1
    settle = waited(WaitedChannel(broken(True)), ray_answer=1)
    assert settle._waited_call("ack", np.array([3])) == 1
    assert settle.calls_in_doubt == 0
