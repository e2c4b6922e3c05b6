"""Hibernation without Ray: which running queues hibernate, and when; what makes a
queue busy (never hibernated)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from raymq.batch import MessageBatch, offsets_of
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.group_commit import INLINE_WRITE_BYTES
from raymq.core.hibernation import Activity, HibernationPolicy, HibernationSettings
from raymq.core.queue import QueueCore
from raymq.errors import InvalidSetting


class Clock:
    """A settable monotonic clock (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(cap: int | None, after: float | None, active: dict[str, str]) -> HibernationPolicy:
    p = HibernationPolicy(HibernationSettings(cap, after))
    for name, node in active.items():
        p.started(name, node)
    return p


def test_activity_counts_idle_time_from_the_last_call_and_none_while_busy():
    clock = Clock()
    activity = Activity(clock)
    clock.now += 7.5
    assert activity.idle_seconds(busy=False) == 7.5
    assert activity.idle_seconds(busy=True) is None
    activity.touch()
    clock.now += 2.0
    assert activity.idle_seconds(busy=False) == 2.0


def test_idle_past_the_timeout_hibernates_below_the_cap():
    p = policy(10, 60.0, {"a": "n1", "b": "n1", "c": "n2"})
    assert p.choose({"a": 60.0, "b": 59.9, "c": 3600.0}) == ["a", "c"]


def test_busy_queues_never_hibernate_even_over_the_timeout_or_cap():
    p = policy(1, 60.0, {"a": "n1", "b": "n1", "c": "n1"})
    assert p.choose({"a": None, "b": None, "c": None}) == []


def test_over_the_cap_the_least_recently_used_idle_queues_go_first():
    p = policy(2, None, {"a": "n1", "b": "n1", "c": "n1", "d": "n1", "e": "n2"})
    # n1 has 4 for a cap of 2: the two idle longest (c, a) go; d is busy; n2 is within.
    assert p.choose({"a": 5.0, "b": 1.0, "c": 9.0, "d": None, "e": 100.0}) == ["a", "c"]


def test_making_room_for_one_more_on_a_node_counts_it():
    p = policy(3, None, {"a": "n1", "b": "n1", "c": "n1", "x": "n2"})
    assert p.needs_room("n1") and not p.needs_room("n2")
    assert p.choose({"a": 1.0, "b": 2.0, "c": 0.5, "x": 9.0}, room_on="n1") == ["b"]
    assert p.choose({"a": 1.0, "b": 2.0, "c": 0.5, "x": 9.0}) == []


def test_a_node_is_over_its_cap_only_past_it():
    p = policy(2, None, {"a": "n1", "b": "n1", "x": "n2"})
    assert not p.over_cap("n1") and p.needs_room("n1")
    p.started("c", "n1")  # started beside others that were starting: none idle
    assert p.over_cap("n1") and not p.over_cap("n2")
    assert not policy(None, None, {"a": "n1"}).over_cap("n1")


def test_queues_hibernated_for_the_timeout_count_toward_making_room():
    p = policy(2, 10.0, {"a": "n1", "b": "n1", "c": "n1"})
    # a goes for its idle time, which already brings n1 within the cap.
    assert p.choose({"a": 11.0, "b": 5.0, "c": 1.0}) == ["a"]


def test_no_cap_and_no_timeout_hibernates_nothing():
    p = policy(None, None, {"a": "n1"})
    assert not p.needs_room("n1")
    assert p.choose({"a": 1e9}) == []


def test_started_and_stopped_track_the_running_queues_per_node():
    p = policy(2, None, {"a": "n1", "b": "n2"})
    p.started("c", "n1")
    p.stopped("b")
    p.stopped("unknown")
    assert p.active() == ["a", "c"] and p.active("n1") == ["a", "c"]
    assert p.active_per_node() == {"n1": 2}
    assert p.is_active("a") and not p.is_active("b")
    # Only running queues are chosen, whatever idle times are reported.
    assert p.choose({"b": 1e9, "a": 1.0, "c": 2.0}, room_on="n1") == ["c"]


@pytest.mark.parametrize(
    ("cap", "after"),
    [(0, 1.0), (True, 1.0), (1.5, 1.0), (1, 0), (1, -1.0), (1, "5"), (1, True)],
)
def test_bad_settings_are_refused_naming_the_setting(cap, after):
    with pytest.raises(InvalidSetting, match="max_active_queues|hibernate_after_seconds"):
        HibernationSettings(cap, after)


def test_broker_config_carries_the_hibernation_settings_checked():
    from raymq.actors.broker_actor import _hibernation_settings

    from raymq.config import BrokerConfig

    cfg = BrokerConfig.from_kwargs(max_active_queues=3, hibernate_after_seconds=2.5)
    assert _hibernation_settings(cfg) == HibernationSettings(3, 2.5)
    assert _hibernation_settings(BrokerConfig()) == HibernationSettings(None, None)
    with pytest.raises(InvalidSetting, match="max_active_queues"):
        BrokerConfig(max_active_queues=0)
    with pytest.raises(InvalidSetting, match="hibernate_after_seconds"):
        BrokerConfig(hibernate_after_seconds=-1)


# -- what makes a queue busy (QueueCore.busy), without Ray ----------------------------


def _batch(bodies: list[bytes]) -> MessageBatch:
    return MessageBatch.from_bodies(bodies, max_message_size=1 << 20)


def _core(tmp_path, **cfg) -> QueueCore:
    return QueueCore(QueueConfig("q", **cfg), BrokerConfig(paging_directory=str(tmp_path)))


def test_a_transient_queue_holding_messages_is_busy_a_durable_one_is_not(tmp_path):
    """A transient queue's files are emptied when it starts again: hibernating it with
    messages would drop sends its producers were told were stored."""

    async def main(durable: bool) -> tuple[bool, bool, bool]:
        q = _core(tmp_path / str(durable), durable=durable)
        q.start()
        empty = q.busy()
        await q.send_batch(_batch([b"a", b"b"]))
        holding = q.busy()
        q.register_consumer("c", prefetch=10)
        got = await q.fetch("c", 10, 5.0, 10)
        await q.ack("c", offsets_of(got))
        q.close_consumer("c")
        drained = q.busy()
        await q.close()
        return empty, holding, drained

    assert asyncio.run(main(durable=True)) == (False, False, False)
    assert asyncio.run(main(durable=False)) == (False, True, False)


def test_a_queue_remembering_delivery_counts_is_busy_until_the_message_is_acked(tmp_path):
    """Delivery counts live only in the queue's process: a hibernation would reset
    them, and a poison message would never reach ``max_delivery_attempts``."""

    async def main() -> list[bool]:
        q = _core(tmp_path, max_delivery_attempts=3)
        q.start()
        await q.send_batch(_batch([b"poison"]))
        q.register_consumer("c1", prefetch=1)
        got = await q.fetch("c1", 1, 5.0, 1)
        q.nack("c1", offsets_of(got))
        q.close_consumer("c1")
        seen = [q.busy()]  # no consumer, nothing in flight: a count of 1 remembered
        q.register_consumer("c2", prefetch=1)
        got = await q.fetch("c2", 1, 5.0, 1)
        await q.ack("c2", offsets_of(got))
        q.close_consumer("c2")
        seen.append(q.busy())
        await q.close()
        return seen

    assert asyncio.run(main()) == [True, False]


def test_a_commit_under_way_keeps_the_queue_busy_and_close_waits_for_it(tmp_path):
    """A large commit writes in a thread with its sends out of the pending list: a
    close meanwhile must let it finish (the sends it wrote are answered), not cancel
    it under the sender."""
    q = _core(tmp_path)
    entered, release = threading.Event(), threading.Event()
    write = q.log.write

    def gated_write(prepared):
        entered.set()
        release.wait(30)
        return write(prepared)

    q.log.write = gated_write
    big = _batch([b"x" * 1024] * (INLINE_WRITE_BYTES // 1024 + 1))

    async def main():
        q.start()
        send = asyncio.ensure_future(q.send_batch(big))
        await asyncio.to_thread(entered.wait, 30)
        busy = q.busy()
        closing = asyncio.ensure_future(q.close())
        release.set()  # the close's first step ran before the write could end
        first, stored = await send
        await closing
        return busy, first, stored

    assert asyncio.run(main()) == (True, 0, len(big))
    reopened = _core(tmp_path)
    try:
        assert reopened.stats().depth == len(big)
    finally:
        asyncio.run(reopened.close())
