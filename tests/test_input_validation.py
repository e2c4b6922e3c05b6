"""Requests are validated where they enter a queue, without Ray: a forged batch gets its
typed error, stores nothing, and the queue (its writer, its selector consumers) keeps
working for everyone else."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore
from raymq.errors import InvalidProperties, MessageTooLarge


def forged(bodies: list[bytes], props: list[bytes]) -> MessageBatch:
    """A batch built from raw property bytes, as a hostile client could send it."""
    return MessageBatch.from_encoded(bodies, props)


@pytest.mark.parametrize(
    "bad",
    [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"k": [1]}), msgpack.packb({1: "x"})],
    ids=["not-msgpack", "not-a-map", "list-value", "int-key"],
)
def test_forged_property_bytes_are_refused_and_the_queue_goes_on(tmp_path, bad):
    q = QueueCore(QueueConfig("q"), BrokerConfig(paging_directory=str(tmp_path)))

    async def main():
        q.start()
        q.register_consumer("reds", 100, "colour = 'red'")  # matching would meet them
        good = msgpack.packb({"colour": "red"})
        with pytest.raises(InvalidProperties, match="message 1 for queue 'q'"):
            await q.send_batch(forged([b"ok", b"forged"], [good, bad]))
        assert q.stats().next_offset == 0  # nothing of that batch stored
        first, n = await asyncio.wait_for(q.send_batch(forged([b"next"], [good])), 30)
        got = await q.fetch("reds", 10, 0, 100)
        await q.close()
        return first, n, got.column("body").to_pylist()

    assert asyncio.run(main()) == (0, 1, [b"next"])


def test_properties_count_toward_max_message_size(tmp_path):
    broker = BrokerConfig(paging_directory=str(tmp_path), max_message_size=1024)
    q = QueueCore(QueueConfig("q"), broker)
    huge = msgpack.packb({"k": "x" * 2**20})

    async def main():
        q.start()
        with pytest.raises(MessageTooLarge, match="queue 'q'"):
            await q.send_batch(forged([b"1"], [huge]))
        await q.send_batch(forged([b"1"], [msgpack.packb({"k": "small"})]))
        stats = q.stats()
        await q.close()
        return stats.next_offset

    assert asyncio.run(main()) == 1
    assert np.diff(forged([b"1"], [huge]).prop_offsets)[0] > 1024


def test_ack_offsets_must_be_integers(tmp_path):
    q = QueueCore(QueueConfig("q"), BrokerConfig(paging_directory=str(tmp_path)))

    async def main():
        q.start()
        await q.send_batch(forged([b"a", b"b"], [b"", b""]))
        q.register_consumer("c", 10)
        await q.fetch("c", 10, 0, 10)
        for bad in ([0.9], np.array([1.0])):
            with pytest.raises(TypeError, match="queue 'q'"):
                await q.ack("c", bad)
            with pytest.raises(TypeError, match="queue 'q'"):
                q.nack("c", bad)
        assert await q.ack("c", [1]) == 1 and q.stats().depth == 1  # offset 0 untouched
        await q.close()

    asyncio.run(main())


def test_a_lone_surrogate_is_not_a_queue_name():
    from raymq.config import validate_queue_name
    from raymq.errors import InvalidQueueName

    with pytest.raises(InvalidQueueName, match="not valid Unicode"):
        validate_queue_name("\ud800")
    assert validate_queue_name("zürich-🚀") == "zürich-🚀"


@pytest.mark.parametrize("n", [3, 100], ids=["a-gather", "a-big-batch"])
def test_the_first_message_over_max_message_size_is_named_in_a_batch_of_any_size(tmp_path, n):
    """Small batches are checked with Python ints, big ones with NumPy: both name the
    first message over the limit, body and properties together, and store nothing."""
    q = QueueCore(QueueConfig("q"), BrokerConfig(paging_directory=str(tmp_path)))
    bad = n - 2
    bodies = [b"x" * 10] * n
    props = [b""] * n
    bodies[bad] = b"x" * (q.broker.max_message_size - 2)
    props[bad] = msgpack.packb({"k": 1})  # 4 bytes: over the limit with them only

    async def main():
        q.start()
        with pytest.raises(MessageTooLarge, match=f"message {bad} for queue 'q'"):
            await q.send_batch(forged(bodies, props))
        assert q.stats().next_offset == 0
        fine = forged(bodies[:bad], props[:bad])
        assert await asyncio.wait_for(q.send_batch(fine), 30) == (0, bad)
        await q.close()

    asyncio.run(main())


def test_sends_waiting_together_share_one_group_commit(tmp_path):
    """Sends that arrive while the writer is busy go in one commit, counted in
    ``group_commits``; ``messages_in / group_commits`` is the messages per commit."""
    q = QueueCore(QueueConfig("q"), BrokerConfig(paging_directory=str(tmp_path)))

    async def main():
        q.start()
        await q.send_batch(forged([b"first"], [b""]))
        # All five are pending before the writer's task runs again: one commit.
        got = await asyncio.gather(*(q.send_batch(forged([b"m"], [b""])) for _ in range(5)))
        stats = q.stats()
        await q.close()
        return sorted(got), stats.messages_in, stats.group_commits

    assert asyncio.run(main()) == ([(k, 1) for k in range(1, 6)], 6, 2)
