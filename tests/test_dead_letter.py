"""Dead letters without Ray: two QueueCores on real files, the source's dead-letter sink
appending to the other (what the queue actor does through the broker actor)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.dead_letter import (
    DEAD_LETTER_REASON,
    ORIGINAL_OFFSET,
    ORIGINAL_QUEUE,
    REASON_MAX_DELIVERY_ATTEMPTS,
    REASON_REJECTED,
)
from raymq.core.queue import QueueCore
from raymq.errors import InvalidAck, InvalidSetting
from raymq.properties import decode_properties

#: Bound on waiting for a background move (seconds): a wedge fails, it is not a timing.
MOVE_DEADLINE_SECONDS = 30.0


class Sink:
    """Appends dead letters to a second queue; can be told to fail."""

    def __init__(self, dlq: QueueCore):
        self.dlq = dlq
        self.failing: Exception | None = None
        self.calls: list[str] = []

    async def __call__(self, name: str, batch: MessageBatch) -> None:
        self.calls.append(name)
        if self.failing is not None:
            raise self.failing
        await self.dlq.send_batch(batch)


def pair(tmp_path, **cfg) -> tuple[QueueCore, QueueCore, Sink]:
    broker = BrokerConfig(paging_directory=str(tmp_path), head_cache_bytes=2**20)
    dlq = QueueCore(QueueConfig("orders.DLQ"), broker)
    sink = Sink(dlq)
    return QueueCore(QueueConfig("orders", **cfg), broker, sink), dlq, sink


def run(scenario, *cores: QueueCore):
    async def main():
        for c in cores:
            c.start()
        try:
            return await scenario()
        finally:
            for c in cores:
                await c.close()

    return asyncio.run(main())


async def send(q: QueueCore, n: int) -> None:
    bodies = [f"m{i}".encode() for i in range(n)]
    props = [{"i": i, "colour": "red" if i % 2 else "blue"} for i in range(n)]
    await q.send_batch(MessageBatch.from_bodies(bodies, props, max_message_size=2**20, queue="t"))


async def moved(q: QueueCore) -> None:
    """Wait until no dead letter is waiting to be moved."""

    async def poll():
        while q.stats().dead_letters_pending:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), MOVE_DEADLINE_SECONDS)


async def fetch_all(q: QueueCore, consumer: str, selector: str | None = None):
    q.register_consumer(consumer, 10_000, selector)
    return await q.fetch(consumer, 10_000, 0.05, 10_000, selector)


def offsets(batch) -> np.ndarray:
    return batch.column("offset").to_numpy()


def test_a_message_nacked_max_delivery_attempts_times_goes_to_the_dlq(tmp_path):
    q, dlq, _ = pair(tmp_path, max_delivery_attempts=3)

    async def scenario():
        await send(q, 5)
        counts = []
        for _ in range(3):
            got = await fetch_all(q, "c")
            assert offsets(got).tolist() == [0, 1, 2, 3, 4]
            counts.append(got.column("delivery_count").to_pylist()[2])
            await q.ack("c", np.array([0, 1, 3, 4]) if _ == 2 else np.zeros(0, np.int64))
            q.nack("c", np.array([2]) if _ == 2 else offsets(got))
        assert counts == [1, 2, 3]
        await moved(q)
        assert (await fetch_all(q, "c")).num_rows == 0  # not a fourth time
        letters = await fetch_all(dlq, "d")
        assert letters.column("body").to_pylist() == [b"m2"]
        props = decode_properties(letters.column("properties").to_pylist()[0])
        assert props == {
            "i": 2,
            "colour": "blue",
            ORIGINAL_QUEUE: "orders",
            ORIGINAL_OFFSET: 2,
            DEAD_LETTER_REASON: REASON_MAX_DELIVERY_ATTEMPTS,
        }
        s = q.stats()
        assert (s.messages_dead_lettered, s.depth, s.in_flight) == (1, 0, 0)
        assert s.dead_letter_queue == "orders.DLQ"

    run(scenario, q, dlq)


def test_reject_dead_letters_at_once_and_only_what_the_consumer_holds(tmp_path):
    q, dlq, _ = pair(tmp_path)  # no max_delivery_attempts: reject works all the same

    async def scenario():
        await send(q, 4)
        got = await fetch_all(q, "c")
        q.register_consumer("other", 10)
        with pytest.raises(InvalidAck):
            q.reject("other", np.array([1]))  # held by "c"
        assert q.reject("c", np.array([1, 3])) == 2
        await moved(q)
        await q.ack("c", np.array([0, 2]))
        letters = await fetch_all(dlq, "d")
        reasons = [
            decode_properties(p)[DEAD_LETTER_REASON]
            for p in letters.column("properties").to_pylist()
        ]
        assert letters.column("body").to_pylist() == [b"m1", b"m3"]
        assert reasons == [REASON_REJECTED] * 2
        assert got.num_rows == 4 and q.stats().depth == 0

    run(scenario, q, dlq)


def test_a_dead_consumer_counts_as_a_delivery(tmp_path):
    q, dlq, _ = pair(tmp_path, max_delivery_attempts=2)

    async def scenario():
        await send(q, 3)
        await fetch_all(q, "c1")
        q.close_consumer("c1")  # as the queue actor does when c1's actor dies
        got = await fetch_all(q, "c2")
        assert got.column("delivery_count").to_pylist() == [2, 2, 2]
        q.close_consumer("c2")
        await moved(q)
        assert (await fetch_all(q, "c3")).num_rows == 0
        assert (await fetch_all(dlq, "d")).num_rows == 3

    run(scenario, q, dlq)


def test_messages_given_back_unseen_do_not_count(tmp_path):
    q, dlq, _ = pair(tmp_path, max_delivery_attempts=1)

    async def scenario():
        await send(q, 3)
        await fetch_all(q, "c")
        q.give_back("c", np.array([0, 1, 2]))  # prefetched, never handed out
        q.close_consumer("c", np.zeros(0, np.int64))
        got = await fetch_all(q, "c2")
        assert got.column("delivery_count").to_pylist() == [1, 1, 1]
        assert q.stats().dead_letters_pending == 0 and q.stats().messages_dead_lettered == 0

    run(scenario, q, dlq)


def test_a_failing_dlq_is_retried_and_the_message_is_never_delivered_meanwhile(tmp_path):
    q, dlq, sink = pair(tmp_path, max_delivery_attempts=1)
    sink.failing = ConnectionError("dead-letter queue unavailable")

    async def scenario():
        await send(q, 2)
        got = await fetch_all(q, "c")
        q.nack("c", offsets(got))

        async def failed_twice():
            while q.stats().dead_letter_failures < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(failed_twice(), MOVE_DEADLINE_SECONDS)
        assert (await fetch_all(q, "c2")).num_rows == 0  # held for the DLQ, not delivered
        s = q.stats()
        assert (s.dead_letters_pending, s.in_flight, s.depth) == (2, 0, 2)
        sink.failing = None
        await moved(q)
        assert q.stats().depth == 0 and (await fetch_all(dlq, "d")).num_rows == 2

    run(scenario, q, dlq)


def test_selector_consumers_are_not_offered_dead_letters(tmp_path):
    q, dlq, _ = pair(tmp_path, max_delivery_attempts=1)

    async def scenario():
        await send(q, 6)
        reds = await fetch_all(q, "reds", "colour = 'red'")
        assert offsets(reds).tolist() == [1, 3, 5]
        q.register_consumer("all", 10_000)
        q.nack("reds", offsets(reds))  # dead letters now
        await moved(q)
        everyone = await fetch_all(q, "all")
        assert offsets(everyone).tolist() == [0, 2, 4]
        assert (await fetch_all(q, "reds", "colour = 'red'")).num_rows == 0
        assert (await fetch_all(dlq, "d")).num_rows == 3

    run(scenario, q, dlq)


def test_dead_letter_settings_are_checked():
    with pytest.raises(InvalidSetting):
        QueueConfig("q", max_delivery_attempts=0)
    with pytest.raises(TypeError):
        QueueConfig("q", max_delivery_attempts=2.5)
    with pytest.raises(InvalidSetting):
        QueueConfig("q", dead_letter_queue="q")
    with pytest.raises(InvalidSetting):
        QueueConfig("x" * 200)  # "x...x.DLQ" would be over the name limit
    assert QueueConfig("x" * 200, dead_letter_queue="dlq").dead_letter_address == "dlq"
    assert QueueConfig("q").dead_letter_address == "q.DLQ"
