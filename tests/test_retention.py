"""Retention and replay without Ray, on real files with an injected clock: the segments'
time index, retention by age and by size that never deletes what a subscription needs,
new subscriptions from the earliest message, an offset or a time, seeks back and
forward, a seek that outlives a restart, filters after a seek, and typed errors."""

from __future__ import annotations

import asyncio
import datetime

import pytest

from raymq.config import QueueConfig
from raymq.core import group_commit
from raymq.core import queue as queue_module
from raymq.core.queue import QueueCore
from raymq.errors import InvalidSetting
from raymq.storage.retention import replay_offset
from tests.test_address import drain, open_address, send
from tests.test_expiry import T0, Clock

MINUTE = 60.0


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(queue_module, "time", c)
    monkeypatch.setattr(group_commit, "time", c)  # the timestamps the writer gives
    return c


def run(coro):
    return asyncio.run(coro)


def _at(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)


async def _settle(core: QueueCore) -> None:
    """Housekeeping (the retention), then the commit that deletes what it let go."""
    core.housekeeping()
    await core.flush_acks()


def test_the_time_index_finds_a_times_first_offset_also_after_a_restart(tmp_path, clock):
    async def first_life():
        core = open_address(tmp_path, retention_s=MINUTE)
        try:
            await core.create_subscription("s")
            for minute in range(5):
                await send(core, 100, start=100 * minute)  # 20 KiB: a segment or two each
                clock.now += MINUTE
            return [replay_offset(core.log, _at(T0 + m * MINUTE), "x") for m in range(6)]
        finally:
            await core.close()

    async def second_life():
        core = open_address(tmp_path, retention_s=MINUTE)
        try:
            return [replay_offset(core.log, _at(T0 + m * MINUTE), "x") for m in range(6)]
        finally:
            await core.close()

    before = run(first_life())
    assert before == [0, 100, 200, 300, 400, 500]
    assert run(second_life()) == before  # from the checkpoint's positions and the tail


def test_retention_by_age_keeps_acknowledged_segments_then_deletes_them(tmp_path, clock):
    async def scenario():
        core = open_address(tmp_path, retention_s=10 * MINUTE)
        try:
            await core.create_subscription("s")
            await send(core, 500)
            assert len(await drain(core, "s")) == 500
            await _settle(core)
            kept = core.stats()
            files = core.log.segment_files
            clock.now += 11 * MINUTE
            await send(core, 1, start=500)  # a newer segment stays
            await _settle(core)
            return kept, files, core.stats(), core.log.segment_files
        finally:
            await core.close()

    kept, files, after, files_after = run(scenario())
    assert (kept.depth, kept.retained, kept.retention_deleted) == (0, 500, 0)
    assert files > 3
    assert after.retention_deleted >= 400 and files_after < files
    assert after.bytes_on_disk < kept.bytes_on_disk


def test_retention_never_deletes_what_a_subscription_has_not_acknowledged(tmp_path, clock):
    async def scenario():
        core = open_address(tmp_path, retention_s=MINUTE)
        try:
            await core.create_subscription("fast")
            await core.create_subscription("slow")
            await send(core, 400)
            await drain(core, "fast")
            clock.now += 10 * MINUTE
            await _settle(core)
            untouched = (core.stats().retention_deleted, core.stats(subscription="slow").depth)
            got = await core.fetch("c", 200, 0, 1000, subscription="slow")
            await core.ack("c", got.column("offset").to_numpy(), subscription="slow")
            await _settle(core)
            return untouched, core.stats(), core.stats(subscription="slow")
        finally:
            await core.close()

    untouched, after, slow = run(scenario())
    assert untouched == (0, 400)
    assert 0 < after.retention_deleted <= 200  # only segments slow acknowledged whole
    assert slow.depth == 200
    assert after.depth == 200 and after.retained == 200 - after.retention_deleted


def test_retention_by_size_keeps_the_newest_bytes(tmp_path, clock):
    keep = 64 * 1024

    async def scenario():
        core = open_address(tmp_path, retention_bytes=keep)
        try:
            await core.create_subscription("s")
            await send(core, 1000)  # ~210 KiB in 16 KiB segments
            await drain(core, "s")
            await _settle(core)
            return core.stats()
        finally:
            await core.close()

    stats = run(scenario())
    assert stats.retention_deleted > 0
    assert keep <= stats.bytes_on_disk < keep + 2 * 16 * 1024


def test_new_subscriptions_start_from_retained_messages(tmp_path, clock):
    async def scenario():
        core = open_address(tmp_path, retention_s=MINUTE)
        try:
            await core.create_subscription("first")
            await send(core, 100)
            clock.now += MINUTE
            await send(core, 100, start=100)
            await drain(core, "first")
            await core.create_subscription("all", start="earliest")
            await core.create_subscription("from150", start=150)
            await core.create_subscription("recent", start=_at(T0 + MINUTE))
            await core.create_subscription("new")
            return {
                name: await drain(core, name, consumer=name)
                for name in ("all", "from150", "recent", "new")
            }
        finally:
            await core.close()

    got = run(scenario())
    assert got["all"] == list(range(200))
    assert got["from150"] == list(range(150, 200))
    assert got["recent"] == list(range(100, 200))
    assert got["new"] == []


def test_a_seek_replays_and_skips_and_outlives_a_restart(tmp_path, clock):
    async def first_life():
        core = open_address(tmp_path, retention_s=MINUTE)
        try:
            await core.create_subscription("s")
            await send(core, 300)
            assert len(await drain(core, "s")) == 300
            back = await core.seek("s", 100)
            again = await drain(core, "s", ack=False)
            ahead = await core.seek("s", 250)
            return back, again, ahead, core.stats(subscription="s").depth
        finally:
            await core.close()

    async def second_life():
        core = open_address(tmp_path, retention_s=MINUTE)
        try:
            return await drain(core, "s")
        finally:
            await core.close()

    back, again, ahead, depth = run(first_life())
    assert (back, ahead) == (100, 250)
    assert again == list(range(100, 300))
    assert depth == 50
    assert run(second_life()) == list(range(250, 300))  # the seek is durable


def test_a_seek_back_applies_the_filter_again(tmp_path, clock):
    async def scenario():
        core = open_address(tmp_path, retention_s=MINUTE)
        try:
            await core.create_subscription("red", filter="color = 'red'")
            await send(core, 10, color="red")
            await send(core, 10, color="blue", start=10)
            first = await drain(core, "red")
            await core.seek("red", "earliest")
            return first, await drain(core, "red")
        finally:
            await core.close()

    first, again = run(scenario())
    assert first == again == list(range(10))


def test_without_retention_a_seek_back_replays_what_the_address_still_stores(tmp_path):
    async def scenario():
        core = open_address(tmp_path)
        try:
            await core.create_subscription("a")
            await core.create_subscription("b")
            await send(core, 100)
            await drain(core, "a")
            await core.seek("a", 0)
            return await drain(core, "a")
        finally:
            await core.close()

    assert run(scenario()) == list(range(100))  # b holds them all still


def test_retention_and_seek_settings_are_checked(tmp_path):
    for bad in [
        {"retention_s": 0},
        {"retention_s": float("inf")},
        {"retention_bytes": -1},
        {"retention_s": 60, "address": False},
        {"retention_s": 60, "address_full_policy": "FAIL"},
        {"retention_s": 60, "durable": False},
    ]:
        with pytest.raises(InvalidSetting, match="retention|'q'"):
            QueueConfig("q", **{"address": True, **bad})

    async def scenario():
        core = open_address(tmp_path, retention_s=MINUTE)
        try:
            await core.create_subscription("s")
            with pytest.raises(InvalidSetting, match="position='middle'.*'addr/s'"):
                await core.seek("s", "middle")
            with pytest.raises(InvalidSetting, match="start=-1"):
                await core.create_subscription("t", start=-1)
        finally:
            await core.close()

    run(scenario())


def test_retention_keeps_what_a_new_earliest_subscription_has_yet_to_read(tmp_path, clock):
    async def scenario():
        core = open_address(tmp_path, retention_s=MINUTE)
        try:
            await core.create_subscription("first")
            await send(core, 300)
            await drain(core, "first")
            await core.create_subscription("late", start="earliest")
            clock.now += 10 * MINUTE  # past the retention: only "late" holds them now
            await send(core, 1, start=300)
            await _settle(core)
            return core.stats().retention_deleted, await drain(core, "late", consumer="l")
        finally:
            await core.close()

    deleted, late = run(scenario())
    assert deleted == 0 and late == list(range(301))


def test_what_an_address_only_retains_is_not_sized_for_the_memory_governor(tmp_path, clock):
    async def scenario():
        core = open_address(tmp_path, retention_s=10 * MINUTE)
        try:
            await core.create_subscription("s")
            await send(core, 500)
            needed = core.usage().size_bytes
            await drain(core, "s")
            return needed, core.usage().size_bytes, core.stats()
        finally:
            await core.close()

    needed, retained_only, stats = run(scenario())
    assert needed > 500 * 200  # 500 bodies of ~200 bytes, all needed
    assert retained_only == 0 and stats.retained == 500 and stats.bytes_on_disk > needed
