"""Producer deduplication without Ray: the id table (an injected clock) and QueueCore on
real files, restarted as the queue actor is (close, open again)."""

from __future__ import annotations

import asyncio
import errno

import numpy as np
import pyarrow as pa
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.duplicate_ids import (
    DUPLICATE_ID_PROPERTY,
    DuplicateIDCache,
    check_message_ids,
    with_message_ids,
)
from raymq.core.queue import QueueCore
from raymq.errors import InvalidSetting, StorageError
from raymq.properties import decode_properties
from raymq.storage.segment import Segment
from tests.storage_helpers import flip


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ids_are_forgotten_after_the_window_and_beyond_the_cache_size():
    clock = Clock()
    cache = DuplicateIDCache(window_s=10.0, max_ids=3, clock=clock)
    cache.remember("a", 0)
    clock.now += 6
    cache.remember("b", 1)
    assert cache.lookup("a") == 0 and cache.lookup("b") == 1
    clock.now += 5  # a is 11 s old, b 5 s
    assert cache.lookup("a") is None and cache.lookup("b") == 1
    for i, mid in enumerate("cde"):
        cache.remember(mid, 2 + i)
    assert len(cache) == 3 and cache.lookup("b") is None  # the oldest went first
    assert [e[0] for e in cache.entries()] == ["c", "d", "e"]


def test_restore_keeps_the_first_offset_of_an_id_and_skips_old_entries():
    clock = Clock()
    cache = DuplicateIDCache(window_s=10.0, max_ids=100, clock=clock)
    now = clock.now
    kept = cache.restore([("x", 7, now - 1), ("x", 3, now - 2), ("old", 1, now - 11)])
    assert kept == 1 and cache.lookup("x") == 3 and cache.lookup("old") is None


def test_a_window_of_zero_remembers_nothing():
    cache = DuplicateIDCache(window_s=0.0, max_ids=100)
    cache.remember("a", 1)
    assert not cache.enabled and cache.lookup("a") is None


@pytest.mark.parametrize(
    "ids",
    [["a"], "ab", ["a", ""], ["a", 5], ["a", "x" * 257]],
)
def test_bad_ids_are_refused_naming_the_queue(ids):
    with pytest.raises(InvalidSetting, match="orders"):
        check_message_ids(ids, 2, "orders")


def test_ids_are_stamped_into_properties_and_arrow_columns():
    bodies, props = with_message_ids([b"1", b"2"], {"k": 1}, ["a", None])
    assert props == [{"k": 1, DUPLICATE_ID_PROPERTY: "a"}, {"k": 1}]
    table = pa.table({"body": [b"1", b"2"]})
    stamped, none = with_message_ids(table, None, ["a", "b"])
    assert none is None and stamped.column(DUPLICATE_ID_PROPERTY).to_pylist() == ["a", "b"]


def _core(tmp_path, **cfg) -> QueueCore:
    broker = BrokerConfig(paging_directory=str(tmp_path), checkpoint_interval=0.05)
    return QueueCore(QueueConfig("orders", **cfg), broker)


def _batch(bodies: list[bytes], ids: list[str | None]) -> MessageBatch:
    b, props = with_message_ids(bodies, None, ids)
    return MessageBatch.from_bodies(b, props, max_message_size=2**20)


async def _started(tmp_path, **cfg) -> QueueCore:
    core = _core(tmp_path, **cfg)
    core.start()
    return core


def test_a_message_sent_again_with_its_id_is_stored_once(tmp_path):
    async def scenario():
        core = await _started(tmp_path)
        try:
            first = await core.send_batch_ids(_batch([b"a", b"b"], ["id-a", None]), ["id-a", None])
            again = await core.send_batch_ids(
                _batch([b"a", b"b", b"c"], ["id-a", None, "id-c"]), ["id-a", None, "id-c"]
            )
            # Twice in one batch, and two concurrent sends of one id: stored once each.
            twice = await core.send_batch_ids(_batch([b"d", b"d"], ["id-d", "id-d"]), ["id-d"] * 2)
            racing = await asyncio.gather(
                *(core.send_batch_ids(_batch([b"e"], ["id-e"]), ["id-e"]) for _ in range(5))
            )
            stats = core.stats()
            stored, _ = core.browse(0, 100)
            return first, again, twice, racing, stats, stored
        finally:
            await core.close()

    first, again, twice, racing, stats, stored = asyncio.run(scenario())
    assert first == [0, 1]
    assert again == [0, 2, 3]  # the duplicate answers with the first one's offset
    assert twice[0] == twice[1] == 4
    assert {r[0] for r in racing} == {5}
    assert stats.duplicates_dropped == 1 + 1 + 4
    assert stats.messages_in == 6 and stats.depth == 6
    bodies = stored.column("body").to_pylist()
    assert bodies == [b"a", b"b", b"b", b"c", b"d", b"e"]
    props = [decode_properties(p) for p in stored.column("properties").to_pylist()]
    assert props[0] == {DUPLICATE_ID_PROPERTY: "id-a"} and props[1] == {}


def test_ids_survive_a_restart_also_of_messages_consumed_and_deleted(tmp_path):
    async def first_run():
        core = await _started(tmp_path, page_size_bytes=4096)
        try:
            await core.send_batch_ids(_batch([b"x" * 3000], ["gone"]), ["gone"])
            await core.send_batch_ids(_batch([b"y" * 3000], ["kept"]), ["kept"])
            await core.send_batch_ids(_batch([b"z"], [None]), [None])
            core.register_consumer("c1", 10)
            got = await core.fetch("c1", 1, 1.0, 10)
            assert got.column("offset").to_pylist() == [0]
            await core.ack("c1", np.array([0]))  # its segment is deleted
            await core.flush_acks()
            return core.stats().segment_files
        finally:
            await core.close()

    async def second_run():
        core = await _started(tmp_path, page_size_bytes=4096)
        try:
            again = await core.send_batch_ids(
                _batch([b"x" * 3000, b"y" * 3000, b"new"], ["gone", "kept", "new"]),
                ["gone", "kept", "new"],
            )
            return again, core.stats()
        finally:
            await core.close()

    segments = asyncio.run(first_run())
    assert segments >= 1
    again, stats = asyncio.run(second_run())
    assert again == [0, 1, 3]
    assert stats.duplicates_dropped == 2 and stats.depth == 3


def test_ids_found_again_from_segments_when_the_checkpoint_is_lost(tmp_path):
    async def run(ids):
        core = await _started(tmp_path)
        try:
            return await core.send_batch_ids(_batch([b"m"] * len(ids), ids), ids)
        finally:
            await core.close()

    assert asyncio.run(run(["a", "b"])) == [0, 1]
    (tmp_path / "orders" / "checkpoint").unlink()
    assert asyncio.run(run(["b", "c"])) == [1, 2]


def test_a_window_of_zero_stores_every_send(tmp_path):
    async def scenario():
        core = await _started(tmp_path, dedup_window_s=0)
        try:
            a = await core.send_batch_ids(_batch([b"m"], ["a"]), ["a"])
            b = await core.send_batch_ids(_batch([b"m"], ["a"]), ["a"])
            return a, b
        finally:
            await core.close()

    assert asyncio.run(scenario()) == ([0], [1])


def test_a_recovery_that_fails_reading_ids_leaves_its_damage_to_the_next(tmp_path, monkeypatch):
    """Reading the producer ids is part of recovery, before the damage found is hidden
    (checkpoint, cut): an open that fails there must leave the next one to find, and
    count, the same damage (the fault simulator's seed 37599 lost that count)."""

    async def send():
        core = await _started(tmp_path)
        try:
            first = await core.send_batch_ids(_batch([b"m"] * 2, ["a", "b"]), ["a", "b"])
            return first + await core.send_batch_ids(_batch([b"m" * 100], ["c"]), ["c"])
        finally:
            await core.close()

    assert asyncio.run(send()) == [0, 1, 2]
    directory = tmp_path / "orders"
    (directory / "checkpoint").unlink()  # every file is scanned again
    (segment,) = directory.glob("*.seg")
    flip(str(segment), segment.stat().st_size - 10)  # the last record fails its CRC

    def failing(self, k):
        raise OSError(errno.EIO, "injected", self.path)

    with monkeypatch.context() as m:
        m.setattr(Segment, "read_properties", failing)
        with pytest.raises(StorageError, match="orders"):
            _core(tmp_path)
    core = _core(tmp_path)
    try:
        assert core.recovery.damaged == 1  # found and counted again
        assert core.recovery.lost_messages == 1
    finally:
        asyncio.run(core.close())


@pytest.mark.parametrize(
    "setting", [{"dedup_window_s": -1}, {"dedup_window_s": "2"}, {"id_cache_size": -1}]
)
def test_bad_dedup_settings_are_refused(setting):
    with pytest.raises((InvalidSetting, TypeError), match="dedup_window_s|id_cache_size"):
        QueueConfig("orders", **setting)
