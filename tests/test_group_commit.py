"""GroupCommit without Ray: what a commit's end lets run before the next commit."""

from __future__ import annotations

import asyncio
import threading

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore


def _one(body: bytes) -> MessageBatch:
    return MessageBatch.from_bodies([body], [None], max_message_size=1024)


def test_a_waiting_fetch_delivers_before_the_next_commit_is_written(tmp_path):
    """Sends keep coming (the next commit is due as one ends): the fetch a commit woke
    takes its messages before the writer writes and fdatasyncs the next commit, not
    after it (at 1,000 msg/s that wait was half of a delivery's time in the queue)."""

    async def main() -> list[str]:
        q = QueueCore(QueueConfig("q", durable=True), BrokerConfig(paging_directory=str(tmp_path)))
        q.start()
        events: list[str] = []
        sends: list[asyncio.Task] = []
        write = q.log.write

        def recorded_write(prepared) -> None:
            write(prepared)
            events.append(f"write {prepared.message_count}")
            if len(sends) == 1:  # the next send arrives while this commit is written
                sends.append(asyncio.ensure_future(q.send_batch(_one(b"second"))))

        q.log.write = recorded_write

        async def fetch() -> None:
            delivery = await q.fetch_delivery("c", 10, 5.0, 100)
            events.append(f"delivered {len(delivery.offsets)}")

        fetching = asyncio.ensure_future(fetch())
        for _ in range(3):  # the fetch finds nothing and waits
            await asyncio.sleep(0)
        assert not fetching.done()
        sends.append(asyncio.ensure_future(q.send_batch(_one(b"first"))))
        await asyncio.wait_for(asyncio.gather(fetching, *sends[:1]), 5)
        await asyncio.wait_for(sends[1], 5)
        await q.close()
        return events

    events = asyncio.run(main())
    assert events[:3] == ["write 1", "delivered 1", "write 1"], events


def test_a_checkpoint_is_written_while_the_queue_delivers(tmp_path):
    """A commit that takes a checkpoint (several syncs, milliseconds) is written off the
    event loop: a fetch of a message published before it is answered while it is
    written. Written in the loop, the write below would wait out its 5 s for a delivery
    that could not run."""

    async def main() -> list[str]:
        q = QueueCore(QueueConfig("q", durable=True), BrokerConfig(paging_directory=str(tmp_path)))
        q.start()
        events: list[str] = []
        delivered = threading.Event()
        write = q.log.write

        def checkpoint_waits_for_a_delivery(prepared) -> None:
            if prepared.checkpoint is not None:
                events.append("checkpoint write starts")
                delivered.wait(5.0)
                events.append("checkpoint write ends")
            write(prepared)

        await q.send_batch(_one(b"published"))
        q.log.write = checkpoint_waits_for_a_delivery
        checkpoint = asyncio.ensure_future(q.commits.checkpoint())

        async def write_started() -> None:
            while "checkpoint write starts" not in events:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(write_started(), 10)
        delivery = await asyncio.wait_for(q.fetch_delivery("c", 10, 5.0, 100), 5)
        events.append(f"delivered {len(delivery.offsets)}")
        delivered.set()
        await asyncio.wait_for(checkpoint, 10)
        await q.close()
        return events

    events = asyncio.run(main())
    # (A housekeeping tick may take another checkpoint after it: only the first counts.)
    assert events[:3] == ["checkpoint write starts", "delivered 1", "checkpoint write ends"], events
