"""TargetArea, HeadQueueCache and OffsetSet through QueueCore, without Ray: selectors
at arrival and for late consumers (segment summaries skip unread), competing
overlapping selectors, redelivery into selector candidates, browsing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.offset_set import OffsetSet
from raymq.core.queue import QueueCore
from raymq.errors import ConsumerClosed, InvalidAck, SelectorError

PAGE = 64 * 1024


def run(coro):
    return asyncio.run(coro)


async def open_core(tmp_path, durable=True, head_cache_bytes=2**20) -> QueueCore:
    core = QueueCore(
        QueueConfig("q", durable=durable, page_size_bytes=PAGE),
        BrokerConfig(paging_directory=str(tmp_path), head_cache_bytes=head_cache_bytes),
    )
    core.start()
    return core


async def send_colors(core: QueueCore, colors: list[str], body: bytes = b"x" * 100) -> None:
    for i in range(0, len(colors), 500):
        chunk = colors[i : i + 500]
        await core.send_batch(
            MessageBatch.from_bodies(
                [body] * len(chunk), [{"color": c} for c in chunk], max_message_size=2**20
            )
        )


def colors_of(batch) -> list[str]:
    import msgpack

    return [msgpack.unpackb(p)["color"] for p in batch.column("properties").to_pylist()]


@pytest.mark.parametrize("durable", [True, False])
def test_red_behind_blue_for_early_and_late_consumers(tmp_path, durable):
    async def main():
        core = await open_core(tmp_path, durable)
        core.register_consumer("early", 100, "color = 'red'")
        await send_colors(core, ["blue"] * 5000 + ["red"] + ["blue"] * 10)
        got = await core.fetch("early", 10, 0, 100)
        assert colors_of(got) == ["red"] and got.column("offset").to_pylist() == [5000]
        await core.ack("early", np.array([5000]))
        await send_colors(core, ["blue"] * 3000 + ["red"] * 2)
        # a late consumer: the stored blues are matched by summary or properties only
        core.register_consumer("late", 100, "color = 'red'")
        got = await core.fetch("late", 10, 0, 100)
        assert got.column("offset").to_pylist() == [8011, 8012]
        stats = core.consumer_stats("late")
        assert stats["scan_remaining"] == 0
        if durable:  # a fresh segment summary rules the all-blue segments out
            assert stats["segments_skipped"] > 0
        assert core.stats().depth == 8012  # 8013 sent, one acked
        await core.close()

    run(main())


def test_late_scan_after_restart_rebuilds_summaries(tmp_path):
    async def main():
        core = await open_core(tmp_path)
        await send_colors(core, ["blue"] * 4000 + ["red"])
        await core.close()
        core = await open_core(tmp_path)
        core.register_consumer("a", 10, "color = 'red'")
        got = await core.fetch("a", 10, 0, 10)
        assert got.column("offset").to_pylist() == [4000]
        scanned = core.consumer_stats("a")["messages_scanned"]
        assert scanned >= 4000  # no summary after a restart: properties were read
        core.register_consumer("b", 10, "color = 'green'")
        assert (await core.fetch("b", 10, 0, 10)).num_rows == 0
        assert core.consumer_stats("b")["segments_skipped"] > 0  # rebuilt by "a"'s scan
        await core.close()

    run(main())


def test_competing_overlapping_selectors_get_each_message_once(tmp_path):
    async def main():
        core = await open_core(tmp_path)
        selectors = {"r": "color IN ('red', 'green')", "g": "color <> 'blue'", "all": None}
        for cid, sel in selectors.items():
            core.register_consumer(cid, 300, sel)
        colors = ["red", "green", "blue"] * 400
        await send_colors(core, colors)
        seen: dict[int, str] = {}
        for _ in range(40):
            for cid in selectors:
                batch = await core.fetch(cid, 37, 0, 300)
                offs = batch.column("offset").to_pylist()
                for o, c in zip(offs, colors_of(batch), strict=True):
                    assert o not in seen, f"{o} delivered twice"
                    seen[o] = cid
                    if cid != "all":
                        assert c != "blue"
                if offs:
                    await core.ack(cid, np.array(offs))
        assert sorted(seen) == list(range(len(colors)))
        await core.close()

    run(main())


def test_released_messages_return_to_matching_selector(tmp_path):
    async def main():
        core = await open_core(tmp_path)
        core.register_consumer("a", 10, "color = 'red'")
        core.register_consumer("b", 10, "color = 'red' AND JMSXDeliveryCount > 1")
        await send_colors(core, ["red", "blue"])
        assert (await core.fetch("b", 10, 0, 10)).num_rows == 0
        got = await core.fetch("a", 10, 0, 10)
        assert got.column("offset").to_pylist() == [0]
        core.nack("a", np.array([0]))
        again = await core.fetch("b", 10, 0, 10)
        assert again.column("offset").to_pylist() == [0]
        assert again.column("delivery_count").to_pylist() == [2]
        await core.close()

    run(main())


def test_browse_changes_nothing(tmp_path):
    async def main():
        core = await open_core(tmp_path, head_cache_bytes=0)
        await send_colors(core, ["blue", "red"] * 1500)
        core.register_consumer("c", 5, None)
        held = await core.fetch("c", 5, 0, 5)
        before = core.stats()
        reds, pos = [], 0
        while pos < core.log.next_offset:
            batch, pos = core.browse(pos, 700, "color = 'red'")
            reds.extend(batch.column("offset").to_pylist())
        assert reds == list(range(1, 3000, 2))
        everything, _ = core.browse(0, 10_000)
        assert everything.num_rows == 3000
        after = core.stats()
        assert (after.depth, after.in_flight) == (before.depth, before.in_flight) == (3000, 5)
        assert held.num_rows == 5
        await core.close()

    run(main())


def test_head_queue_cache_serves_a_late_consumer_and_refills(tmp_path):
    async def main():
        core = await open_core(tmp_path, head_cache_bytes=200 * 1024)
        await send_colors(core, ["blue"] * 4000, body=b"y" * 100)  # ~400 KiB: cache fills
        assert 0 < core.head_cache.bytes <= 200 * 1024 and core.head_cache.behind
        core.register_consumer("c", 5000, None)
        got = await core.fetch("c", 1000, 0, 5000)
        assert got.column("offset").to_pylist() == list(range(1000))
        assert core.stats().head_cache_hits == 1
        await core.ack("c", got.column("offset").to_numpy())
        core.housekeeping()  # trims what was delivered, refills from the log
        assert core.head_cache.start == 1000 and core.head_cache.end > 2000
        await core.close()

    run(main())


def test_bad_selector_registers_nothing(tmp_path):
    async def main():
        core = await open_core(tmp_path)
        with pytest.raises(SelectorError, match="position 9"):
            core.register_consumer("x", 10, "color = ")
        assert "x" not in core.area.consumers
        await core.close()

    run(main())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 300_000), max_size=300), st.integers(0, 300_000))
def test_offset_set_matches_python_set(values, start):
    s, ref = OffsetSet(), set(values)
    s.add(np.array(values, dtype=np.int64))
    assert len(s) == len(ref)
    assert s.first(50, start).tolist() == sorted(v for v in ref if v >= start)[:50]
    s.discard(np.array(values[::2], dtype=np.int64))
    ref -= set(values[::2])
    assert s.first(10**6).tolist() == sorted(ref)
    s.discard_below(start)
    assert s.first(10**6).tolist() == sorted(v for v in ref if v >= start)


def test_offset_released_twice_is_delivered_once(tmp_path):
    async def main():
        core = await open_core(tmp_path)
        await send_colors(core, ["red", "blue"])
        for cid in ("a", "b"):  # each takes the red one and gives it back in turn
            core.register_consumer(cid, 10, "color = 'red'")
            got = await core.fetch(cid, 10, 0, 10)
            assert got.column("offset").to_pylist() == [0]
            core.close_consumer(cid)
        core.register_consumer("plain", 10, None)
        got = await core.fetch("plain", 10, 0, 10)
        assert got.column("offset").to_pylist() == [0, 1]
        assert got.column("delivery_count").to_pylist() == [3, 1]
        assert core.close_consumer("plain") == 2
        await core.close()

    run(main())


def test_a_fetch_after_or_during_a_close_takes_nothing(tmp_path):
    """A TargetList's fetch can reach the queue after its close: it must not register
    the consumer again and take messages that nobody would ever ack or give back."""

    async def main():
        core = await open_core(tmp_path)
        core.register_consumer("gone", 100)
        waiting = asyncio.ensure_future(core.fetch("gone", 10, 5.0, 100))
        await asyncio.sleep(0)  # the fetch is waiting for messages now
        core.close_consumer("gone")
        await send_colors(core, ["red"] * 3)
        assert (await waiting).num_rows == 0
        with pytest.raises(ConsumerClosed):
            await core.fetch("gone", 10, 0, 100)
        assert core.stats().in_flight == 0 and "gone" not in core.area.consumers
        core.register_consumer("other", 100)
        assert (await core.fetch("other", 10, 0, 100)).num_rows == 3
        await core.close()

    run(main())


def test_ack_acceptable_acks_what_the_consumer_may_and_names_the_rest(tmp_path):
    """After the queue refused a gathered ack whole: one call acks the offsets the
    consumer may ack and names the refused ones (another's, never sent)."""

    async def main():
        core = await open_core(tmp_path)
        await send_colors(core, ["red"] * 10)
        core.register_consumer("a", 5, None)
        core.register_consumer("b", 5, None)
        mine = (await core.fetch("a", 5, 0, 5)).column("offset").to_pylist()
        theirs = (await core.fetch("b", 5, 0, 5)).column("offset").to_pylist()
        offsets = np.array([*mine, theirs[0], 10**9], dtype=np.int64)
        with pytest.raises(InvalidAck):
            await core.ack("a", offsets)  # together: refused, nothing changes
        assert core.stats().depth == 10
        fresh, refusal = await core.ack_acceptable("a", offsets)
        assert fresh == 5 and core.stats().depth == 5
        assert str(10**9) in refusal and "never sent" in refusal
        fresh, refusal = await core.ack_acceptable("a", np.array(theirs[:2], dtype=np.int64))
        assert fresh == 0 and "another consumer" in refusal and core.stats().depth == 5
        assert await core.ack_acceptable("b", np.array(theirs, dtype=np.int64)) == (5, "")
        await core.close()

    run(main())
