"""No internal task of a queue dies from an exception (without Ray): the writer and the
housekeeping task are restarted, every caller gets an answer, and the queue goes on."""

from __future__ import annotations

import asyncio

import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore
from raymq.core.supervisor import Supervisor

#: Bound on a call that must return (seconds): a wedge fails the test.
ANSWER_SECONDS = 30.0


def batch(*bodies: bytes) -> MessageBatch:
    return MessageBatch.from_bodies(list(bodies), None, max_message_size=2**20)


def fail_once(obj, name: str, exc: Exception) -> list[int]:
    """Make ``obj.name`` raise ``exc`` on its first call only; returns the call count."""
    original = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise exc
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


def test_a_writer_that_raises_answers_its_callers_and_is_restarted(tmp_path):
    q = QueueCore(QueueConfig("q"), BrokerConfig(paging_directory=str(tmp_path)))

    async def main():
        q.start()
        fail_once(q.log, "publish", RuntimeError("a bug in publish"))
        with pytest.raises(RuntimeError, match="a bug in publish"):
            await asyncio.wait_for(q.send_batch(batch(b"first")), ANSWER_SECONDS)
        first, n = await asyncio.wait_for(q.send_batch(batch(b"second")), ANSWER_SECONDS)
        stats = q.stats()
        await asyncio.wait_for(q.close(), ANSWER_SECONDS)
        return n, stats

    n, stats = asyncio.run(main())
    assert n == 1 and stats.task_restarts == 1 and "a bug in publish" in stats.last_task_error


def test_an_error_after_a_durable_commit_does_not_fail_the_send(tmp_path):
    q = QueueCore(QueueConfig("q"), BrokerConfig(paging_directory=str(tmp_path)))

    async def main():
        q.start()
        q.register_consumer("c", 10)
        fail_once(q.area, "arrived", RuntimeError("matching failed"))
        first, n = await asyncio.wait_for(q.send_batch(batch(b"kept")), ANSWER_SECONDS)
        got = await q.fetch("c", 10, 0, 10)
        stats = q.stats()
        await q.close()
        return (first, n), got.column("body").to_pylist(), stats

    stored, bodies, stats = asyncio.run(main())
    assert stored == (0, 1) and bodies == [b"kept"]  # durable, and delivered
    assert stats.internal_errors == 1 and stats.task_restarts == 0


def test_housekeeping_that_raises_is_restarted(tmp_path):
    broker = BrokerConfig(paging_directory=str(tmp_path), checkpoint_interval=0.01)
    q = QueueCore(QueueConfig("q"), broker)

    async def main():
        calls = fail_once(q, "housekeeping", OSError("EIO reading a page"))
        q.start()

        async def ran_again():
            while calls[0] < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(ran_again(), ANSWER_SECONDS)
        stats = q.stats()
        await q.close()
        return stats

    stats = asyncio.run(main())
    assert stats.task_restarts == 1 and "EIO" in stats.last_task_error


def test_cancelling_ends_supervised_tasks():
    import logging

    async def main():
        sup = Supervisor("test", logging.getLogger("test"))
        started = asyncio.Event()

        async def forever():
            started.set()
            await asyncio.Event().wait()

        task = sup.spawn("forever", forever)
        await started.wait()
        await sup.cancel_all()
        return task.cancelled(), sup.stats()

    cancelled, stats = asyncio.run(main())
    assert cancelled and stats.task_restarts == 0


def test_a_task_that_lost_its_cancel_is_cancelled_again():
    """Python 3.11's ``wait_for`` can swallow a cancel that lands as its inner call
    finishes: the task goes on. ``cancel_all`` must still end it, not wait for ever."""
    import logging

    async def main():
        sup = Supervisor("test", logging.getLogger("test"))
        started, lost = asyncio.Event(), []

        async def loses_one_cancel():
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                lost.append(True)  # as wait_for returning its result would
            await asyncio.Event().wait()

        task = sup.spawn("loop", loses_one_cancel)
        await started.wait()
        async with asyncio.timeout(30):  # a bound on the test only
            await sup.cancel_all()
        return task.cancelled(), lost

    cancelled, lost = asyncio.run(main())
    assert cancelled and lost == [True]


def test_a_task_that_never_ends_is_left_behind_logged(monkeypatch, caplog):
    import logging

    from raymq.core import supervisor

    monkeypatch.setattr(supervisor, "CANCEL_AGAIN_SECONDS", 0.01)
    monkeypatch.setattr(supervisor, "CANCEL_ATTEMPTS", 3)

    async def main():
        sup = Supervisor("queue 'stubborn'", logging.getLogger("test"))
        started, cancels = asyncio.Event(), []

        async def ignores_cancels():  # ends at its fourth cancel, one past cancel_all
            started.set()
            while len(cancels) < 4:
                try:
                    await asyncio.sleep(1)
                except asyncio.CancelledError:
                    cancels.append(True)

        task = sup.spawn("stubborn", ignores_cancels)
        await started.wait()
        await sup.cancel_all()
        left, seen = not task.done(), len(cancels)
        task.cancel()
        await asyncio.wait([task])
        return left, seen

    with caplog.at_level(logging.ERROR, logger="test"):
        left, cancels = asyncio.run(main())
    assert left and cancels == 3
    assert "queue 'stubborn': tasks ['stubborn'] still running after 3 cancels" in caplog.text


def test_cancelling_no_tasks_returns():
    import logging

    asyncio.run(Supervisor("idle", logging.getLogger("test")).cancel_all())
