"""Addresses without Ray: one stored copy, fanned out to subscriptions with their own
ack state (issue 13). Routing filters, start positions, segment deletion once every
subscription is done (middle segments too), subscriptions and their acks across a
restart and a kill (a copy of the files taken while the address runs), typed errors."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading

import msgpack
import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore
from raymq.errors import (
    ConsumerClosed,
    InvalidQueueName,
    InvalidSetting,
    SelectorError,
    StorageError,
    SubscriptionExists,
    SubscriptionNotFound,
)
from raymq.properties import decode_properties
from raymq.storage.format import SEGMENT_SUFFIX
from raymq.storage.subscriptions import MANIFEST_NAME
from tests.storage_helpers import flip

PAGE = 16 * 1024  # small segments: deletion of middle ones shows


#: Bound on a wait that must end, in real seconds: only a wedge takes this long.
WAIT_SECONDS = 30.0


def run(coro):
    return asyncio.run(coro)


def open_address(root, name="addr", *, head_cache_bytes=2**20, share=None, **kw) -> QueueCore:
    core = QueueCore(
        QueueConfig(name, page_size_bytes=PAGE, address=True, **kw),
        BrokerConfig(paging_directory=str(root), head_cache_bytes=head_cache_bytes),
        share=share,
    )
    core.start()
    return core


async def send(core: QueueCore, n: int, color: str | None = None, start: int = 0) -> list[int]:
    bodies = [f"m{start + i}".encode() + b"." * 200 for i in range(n)]
    props = None if color is None else [{"color": color, "i": start + i} for i in range(n)]
    first, count = await core.send_batch(
        MessageBatch.from_bodies(bodies, props, max_message_size=2**20)
    )
    assert count == n
    return list(range(first, first + n))


async def drain(core: QueueCore, sub: str, consumer: str = "c", ack: bool = True) -> list[int]:
    """Everything the subscription delivers now, acknowledged (unless ``ack`` False)."""
    got: list[int] = []
    while True:
        batch = await core.fetch(consumer, 1000, 0, 1000, subscription=sub)
        if not batch.num_rows:
            return got
        offsets = batch.column("offset").to_numpy()
        got.extend(offsets.tolist())
        if ack:
            await core.ack(consumer, offsets, subscription=sub)


def segment_bases(core: QueueCore) -> list[int]:
    names = [n for n in os.listdir(core.directory) if n.endswith(SEGMENT_SUFFIX)]
    return sorted(int(n[: -len(SEGMENT_SUFFIX)]) for n in names)


def test_each_subscription_gets_every_message_from_one_stored_copy(tmp_path):
    async def main():
        core = open_address(tmp_path)
        for name in ("a", "b", "c"):
            await core.create_subscription(name)
        sent = await send(core, 500)
        on_disk = core.log.bytes_on_disk
        for name in ("a", "b", "c"):
            assert await drain(core, name) == sent
        assert core.stats().messages_out == 1500
        # one copy: three subscriptions cost no more bytes than the records themselves
        assert on_disk < 500 * 260
        await core.close()

    run(main())


class Shared:
    """What ``share`` made: one per cached batch (the shell's ray.put makes an object)."""

    def __init__(self, batch):
        self.batch = batch


def test_every_subscription_is_delivered_references_to_one_shared_copy(tmp_path):
    made: list[Shared] = []

    def share(batch):
        made.append(Shared(batch))
        return made[-1]

    async def main():
        core = open_address(tmp_path, share=share)
        await core.create_subscription("a")
        await send(core, 10)
        # Alone, a subscription is delivered each batch once: nothing is shared.
        alone = await core.fetch_delivery("c", 1000, 0, 1000, subscription="a")
        assert alone.parts == [] and alone.batch.num_rows == 10 and not made
        await core.ack("c", alone.offsets, subscription="a")
        for name in ("b", "c"):
            await core.create_subscription(name)
        sent = await send(core, 500, start=10)
        refs = {}
        for name in ("a", "b", "c"):
            d = await core.fetch_delivery("c", 1000, 0, 1000, subscription=name)
            assert d.batch is None and d.offsets.tolist() == sent
            refs[name] = [p.ref for p in d.parts]
            rows = [p.ref.batch.slice(p.first_row, p.rows) for p in d.parts]
            assert [o for r in rows for o in r.column("offset").to_pylist()] == sent
        # One shared object per stored chunk (a segment file holds ~60 of these).
        assert refs["a"] == refs["b"] == refs["c"] == made and len(made) > 1
        # A redelivery carries its delivery count: made for it, not shared.
        core.nack("c", np.array(sent[:10]), subscription="b")
        again = await core.fetch_delivery("c", 1000, 0, 1000, subscription="b")
        assert again.batch is not None and again.offsets.tolist() == sent[:10]
        assert again.batch.column("delivery_count").to_pylist() == [2] * 10
        assert len(made) == len(refs["a"])
        await core.close()

    run(main())


def test_a_delivery_beyond_the_head_cache_is_shared_as_far_as_it_reaches(tmp_path, monkeypatch):
    monkeypatch.setattr("raymq.core.queue_memory.SHARED_MIN_ROWS", 1)  # 16 KiB pages: small chunks

    async def main():
        core = open_address(tmp_path, head_cache_bytes=80 * 1024)  # ~300 of the messages
        for name in ("a", "b"):
            await core.create_subscription(name)
        sent = []
        for k in range(10):  # batches of 100: the cache takes the first few whole
            sent += await send(core, 100, start=100 * k)
        cached = core.head_cache.messages
        assert 0 < cached < 1000
        d = await core.fetch_delivery("c", 1000, 0, 1000, subscription="a")
        shared = sum(p.rows for p in d.parts)  # the cache reads ahead into what room is left
        assert cached <= shared == core.head_cache.end < 1000
        assert d.batch.num_rows == 1000 - shared
        assert d.offsets.tolist() == sent
        assert d.to_batch().column("offset").to_pylist() == sent
        await core.close()

    run(main())


def test_single_sends_are_delivered_in_a_batch_made_for_the_delivery(tmp_path):
    async def main():
        core = open_address(tmp_path)
        for name in ("a", "b"):
            await core.create_subscription(name)
        sent = []
        for k in range(200):  # one message a batch: a put each would cost more
            sent += await send(core, 1, start=k)
        d = await core.fetch_delivery("c", 1000, 0, 1000, subscription="a")
        assert d.parts == [] and d.batch.column("offset").to_pylist() == sent
        assert core.head_cache.shared_batches == 0
        await core.close()

    run(main())


def test_a_share_that_fails_delivers_a_batch_of_its_own(tmp_path):
    def share(batch):
        raise MemoryError("object store full")

    async def main():
        core = open_address(tmp_path, share=share)
        for name in ("a", "b"):
            await core.create_subscription(name)
        sent = await send(core, 100)
        d = await core.fetch_delivery("c", 1000, 0, 1000, subscription="a")
        assert d.parts == [] and d.batch.column("offset").to_pylist() == sent
        await core.close()

    run(main())


def test_a_stopped_subscription_does_not_push_the_others_out_of_the_head_cache(tmp_path):
    async def main():
        # 64 KiB of cache, 20 x 50 messages of ~260 bytes: 260 KiB sent while one
        # subscription takes nothing.
        core = open_address(tmp_path, head_cache_bytes=64 * 1024)
        for name in ("stopped", "b", "c"):
            await core.create_subscription(name)
        sent = []
        for k in range(20):
            sent += await send(core, 50, start=50 * k)
            for name in ("b", "c"):
                assert await drain(core, name, consumer=name) == sent[-50:]
            core.housekeeping()
        for name in ("b", "c"):
            st = core.stats(name)
            assert (st.head_cache_hits, st.head_cache_misses) == (20, 0), name
        assert core.head_cache.bytes <= 64 * 1024
        assert await drain(core, "stopped", consumer="s") == sent  # from the pages
        assert core.stats("stopped").head_cache_misses > 0
        await core.close()

    run(main())


def test_a_segment_goes_once_every_subscription_acknowledged_it_middle_ones_too(tmp_path):
    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("fast")
        await core.create_subscription("slow")
        sent = []
        for i in range(10):
            sent += await send(core, 100, start=i * 100)
        bases = segment_bases(core)
        assert len(bases) >= 5
        assert await drain(core, "fast") == sent
        assert segment_bases(core) == bases  # slow still needs every one
        # slow acknowledges only the messages of the second and third segments
        middle = np.arange(bases[1], bases[3], dtype=np.int64)
        got = await drain(core, "slow", ack=False)
        await core.ack("c", middle, subscription="slow")
        await core.flush_acks()
        left = segment_bases(core)
        assert bases[1] not in left and bases[2] not in left
        assert bases[0] in left and bases[3] in left
        assert core.stats("slow").depth == len(sent) - len(middle)
        assert core.stats("fast").depth == 0
        assert got == sent
        await core.close()

    run(main())


def test_a_subscription_filter_routes_only_what_it_selects(tmp_path):
    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("red", filter="color = 'red'")
        await core.create_subscription("all")
        red = await send(core, 30, "red")
        blue = await send(core, 40, "blue", start=30)
        red += await send(core, 5, "red", start=70)
        assert core.stats("red").depth == 35
        assert core.stats("all").depth == 75
        assert await drain(core, "red") == red
        # a consumer's selector applies on top of the filter
        core.register_consumer("big", 100, "i >= 72", subscription="red")
        assert await drain(core, "all") == red[:30] + blue + red[30:]
        await core.close()

    run(main())


def test_a_commit_is_routed_before_a_fetch_can_run_while_its_deleted_files_are_unlinked(
    tmp_path, monkeypatch
):
    """A commit that deleted a segment unlinks its file in a thread, after the commit
    was published: a fetch running then took a message the filter rejects if the
    routing came after the unlink (found by bench.chaos: 4 misrouted of 283,436)."""

    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("red", filter="color = 'red'")
        for i in range(6):
            await send(core, 100, "red", start=i * 100)
        bases = segment_bases(core)
        assert len(bases) >= 3
        assert len(await drain(core, "red", ack=False)) == 600  # all held by "c"
        unlinking, proceed = threading.Event(), threading.Event()
        unlink = core.log.unlink_deleted

        def slow_unlink() -> None:
            unlinking.set()
            proceed.wait(WAIT_SECONDS)
            unlink()

        monkeypatch.setattr(core.log, "unlink_deleted", slow_unlink)
        # One commit: the first segment's acks (it is deleted) and a blue message the
        # filter rejects.
        acking = asyncio.create_task(
            core.ack("c", np.arange(bases[0], bases[1]), subscription="red")
        )
        sending = asyncio.create_task(send(core, 1, "blue", start=600))
        assert await asyncio.to_thread(unlinking.wait, WAIT_SECONDS)
        try:
            assert not sending.done()  # its commit is published, not answered yet
            fetched = await core.fetch("other", 1000, 0, 1000, subscription="red")
        finally:
            proceed.set()
        await acking
        (blue,) = await sending
        assert blue not in fetched.column("offset").to_pylist()
        assert fetched.num_rows == 0  # the rest is held by "c"
        assert core.stats("red").depth == 600 - (bases[1] - bases[0])
        await core.close()

    run(main())


def test_an_earliest_filter_over_a_backlog_is_routed_while_the_address_serves_sends(
    tmp_path, monkeypatch
):
    # Many steps, so that the routing outlasts a few sends however slow their commits
    # (with 100 a step, a checkpoint in every commit let it end within one).
    monkeypatch.setattr("raymq.core.address.ROUTE_STEP_MESSAGES", 25)

    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("all")
        red = []
        for k in range(10):  # 1000 stored: half red
            red += await send(core, 50, "red", start=100 * k)
            await send(core, 50, "blue", start=100 * k + 50)
        creating = asyncio.ensure_future(
            core.create_subscription("late", filter="color = 'red'", start="earliest")
        )
        during = routing = 0
        while not creating.done():  # sends are served between the steps
            red += await send(core, 10, "red", start=1000 + 20 * during)
            await send(core, 10, "blue", start=1010 + 20 * during)
            during += 1
            routing += "late" not in [s.name for s in core.list_subscriptions()]
        spec = await creating
        assert routing >= 2, "the routing held the actor until it was done"
        same = await core.create_subscription("late", filter="color = 'red'", start="earliest")
        assert same == spec and core.list_subscriptions()[-1] == spec
        red += await send(core, 5, "red", start=5000)
        assert await drain(core, "late") == red
        await core.close()

    run(main())


def test_earliest_starts_at_the_oldest_stored_message_latest_at_the_next(tmp_path):
    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("first")
        before = await send(core, 50)
        await drain(core, "first", ack=False)
        await core.ack("c", np.arange(0, 10), subscription="first")
        await core.create_subscription("early", start="earliest")
        await core.create_subscription("late", start="latest")
        after = await send(core, 20, start=50)
        # 0-9 were acknowledged by every subscription there was: no longer stored
        assert await drain(core, "early") == before[10:] + after
        assert await drain(core, "late") == after
        await core.close()

    run(main())


def test_messages_sent_to_an_address_without_subscriptions_are_not_kept(tmp_path):
    async def main():
        core = open_address(tmp_path)
        await send(core, 100)
        await send(core, 100, start=100)
        await core.flush_acks()
        assert core.stats().depth == 0
        await core.create_subscription("s", start="earliest")
        assert await drain(core, "s") == []
        await core.close()

    run(main())


def test_deleting_a_subscription_releases_its_hold_and_closes_its_consumers(tmp_path):
    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("keep")
        await core.create_subscription("gone")
        sent = []
        for i in range(6):
            sent += await send(core, 100, start=i * 100)
        core.register_consumer("g", 10, subscription="gone")
        assert await drain(core, "keep") == sent
        assert len(segment_bases(core)) > 1
        await core.delete_subscription("gone")
        await send(core, 1, start=600)  # a commit deletes what nobody needs
        assert len(segment_bases(core)) == 1
        with pytest.raises(SubscriptionNotFound, match="gone"):
            await core.fetch("g", 10, 0, 10, subscription="gone")
        assert [s.name for s in core.list_subscriptions()] == ["keep"]
        await core.close()
        core = open_address(tmp_path)
        assert [s.name for s in core.list_subscriptions()] == ["keep"]
        assert core.stats().depth == 1
        await core.close()

    run(main())


def test_subscriptions_positions_and_acks_survive_a_restart(tmp_path):
    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("a")
        await core.create_subscription("b", filter="color = 'red'")
        sent = await send(core, 60, "red") + await send(core, 40, "blue", start=60)
        got = await drain(core, "a", ack=False)
        await core.ack("c", np.array(got[:70]), subscription="a")
        await core.close()
        core = open_address(tmp_path)
        assert core.stats("a").depth == 30 and core.stats("b").depth == 60
        assert await drain(core, "a") == sent[70:]
        assert await drain(core, "b") == sent[:60]
        await core.close()

    run(main())


@pytest.mark.parametrize("checkpoint_interval", [0.001, 3600.0])
def test_acknowledged_state_survives_a_kill(tmp_path, checkpoint_interval):
    """A copy of the files taken while the address runs is what a SIGKILL leaves (the
    process dies, the page cache stays). Acks that returned are kept; filters routed
    after the last checkpoint are routed again."""

    async def main():
        broker = BrokerConfig(
            paging_directory=str(tmp_path / "live"), checkpoint_interval=checkpoint_interval
        )
        core = QueueCore(QueueConfig("addr", page_size_bytes=PAGE, address=True), broker)
        core.start()
        await core.create_subscription("a")
        await core.create_subscription("red", filter="color = 'red'")
        red = await send(core, 50, "red")
        blue = await send(core, 50, "blue", start=50)
        got = await drain(core, "a", ack=False)
        await core.ack("c", np.array(got[:80]), subscription="a")
        assert await drain(core, "red") == red
        shutil.copytree(tmp_path / "live", tmp_path / "killed")
        await core.close()
        core = QueueCore(
            QueueConfig("addr", page_size_bytes=PAGE, address=True),
            BrokerConfig(paging_directory=str(tmp_path / "killed")),
        )
        core.start()
        assert core.stats("red").depth == 0
        assert await drain(core, "a") == (red + blue)[80:]
        assert await drain(core, "red") == []
        await core.close()

    run(main())


def test_typed_errors_name_the_address_subscription_or_setting(tmp_path):
    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("s", filter="color = 'red'")
        assert (await core.create_subscription("s", filter="color = 'red'")).name == "s"
        with pytest.raises(SubscriptionExists, match="'s'"):
            await core.create_subscription("s")
        with pytest.raises(SubscriptionNotFound, match="addr.*'nope'"):
            await core.fetch("c", 1, 0, 1, subscription="nope")
        with pytest.raises(SubscriptionNotFound):
            await core.fetch("c", 1, 0, 1)  # an address has no subscription of its own
        with pytest.raises(SelectorError):
            await core.create_subscription("bad", filter="color = ")
        with pytest.raises(InvalidSetting, match="start='middle'"):
            await core.create_subscription("t", start="middle")
        with pytest.raises(InvalidQueueName):
            await core.create_subscription("../x")
        with pytest.raises(InvalidSetting, match="max_delivery_attempts"):
            await core.create_subscription("t", max_delivery_attempts=0)
        assert [s.name for s in core.list_subscriptions()] == ["s"]
        core.register_consumer("c", 10, subscription="s")
        await core.delete_subscription("s")
        with pytest.raises((ConsumerClosed, SubscriptionNotFound)):
            await core.fetch("c", 1, 0, 1, subscription="s")
        await core.close()
        queue = QueueCore(QueueConfig("plain"), BrokerConfig(paging_directory=str(tmp_path)))
        queue.start()
        with pytest.raises(InvalidSetting, match="'plain' is a queue"):
            await queue.create_subscription("s")
        with pytest.raises(SubscriptionNotFound, match="'plain' is a queue"):
            await queue.fetch("c", 1, 0, 1, subscription="s")
        await queue.close()

    run(main())


def test_a_damaged_subscriptions_file_is_a_storage_error_naming_it(tmp_path):
    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("s")
        await core.close()
        path = os.path.join(core.directory, MANIFEST_NAME)
        with open(path, "r+b") as f:
            f.seek(30)
            byte = f.read(1)
            f.seek(30)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(StorageError, match=MANIFEST_NAME):
            open_address(tmp_path)

    run(main())


def test_stats_give_each_subscriptions_lag(tmp_path):
    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("a")
        await core.create_subscription("b")
        await send(core, 100)
        await drain(core, "a")
        assert core.subscription_depths() == {"a": 0, "b": 100}
        assert core.stats().depth == 100 and core.stats("a").name == "addr/a"
        props = msgpack.packb({"color": "red"})
        assert props  # (properties round trip through the address as through a queue)
        await core.close()

    run(main())


def test_routing_not_yet_on_disk_at_a_kill_is_done_again(tmp_path):
    """A filter's decisions reach the ack log with the commit after the messages'; a
    kill in between leaves them undone, and recovery routes those messages again."""

    async def main():
        core = open_address(tmp_path / "live")
        await core.create_subscription("red", filter="color = 'red'")
        red = await send(core, 20, "red")
        got = await core.fetch("c", 1, 0, 10, subscription="red")
        await core.ack("c", got.column("offset").to_numpy(), subscription="red")  # durable
        core.close_consumer("c", subscription="red")
        red = red[1:]
        await send(core, 30, "blue", start=20)
        assert core.log.has_pending_acks  # the blues' routing is not on disk yet
        shutil.copytree(tmp_path / "live", tmp_path / "killed")
        await core.close()
        core = open_address(tmp_path / "killed")
        assert core.stats("red").depth == 19
        # killed again at once: the routing done by that recovery was made durable
        # before it returned (its checkpoint covers the blues: never scanned again)
        shutil.copytree(tmp_path / "killed", tmp_path / "killed-again")
        await core.close()
        core = open_address(tmp_path / "killed-again")
        assert core.stats("red").depth == 19
        assert await drain(core, "red") == red
        await core.close()

    run(main())


def test_a_subscriptions_dead_letters_go_to_its_own_dead_letter_queue(tmp_path):
    moved: list[tuple[str, list[int]]] = []

    async def sink(name: str, batch: MessageBatch) -> None:
        props = [
            decode_properties(batch.prop_data[a:b])
            for a, b in zip(batch.prop_offsets[:-1], batch.prop_offsets[1:], strict=True)
        ]
        moved.append((name, [p["RayMQOriginalOffset"] for p in props]))

    async def all_moved(core: QueueCore) -> None:
        while core.stats().dead_letters_pending:
            await asyncio.sleep(0.01)  # the mover runs in the background

    async def main():
        core = QueueCore(
            QueueConfig("addr", page_size_bytes=PAGE, address=True),
            BrokerConfig(paging_directory=str(tmp_path)),
            sink,
        )
        core.start()
        await core.create_subscription("once", max_delivery_attempts=1)
        await core.create_subscription("other", dead_letter_queue="elsewhere")
        await send(core, 3)
        got = await core.fetch("c", 10, 0, 10, subscription="once")
        core.nack("c", got.column("offset").to_numpy(), subscription="once")
        other = await core.fetch("d", 10, 0, 10, subscription="other")
        core.reject("d", other.column("offset").to_numpy()[:1], subscription="other")
        await asyncio.wait_for(all_moved(core), 30)  # a wedge fails; not a timing
        assert sorted(moved) == [("addr.once.DLQ", [0, 1, 2]), ("elsewhere", [0])]
        assert core.stats("once").depth == 0 and core.stats("other").depth == 2
        assert core.stats("once").messages_dead_lettered == 3
        await core.close()

    run(main())


def _one(body: bytes, k: int) -> MessageBatch:
    return MessageBatch.from_bodies([body], [{"k": k}], max_message_size=1 << 20)


def _hourly(root) -> QueueCore:
    """An address whose only checkpoints are recovery's."""
    core = QueueCore(
        QueueConfig("addr", page_size_bytes=PAGE, address=True),
        BrokerConfig(paging_directory=str(root), checkpoint_interval=3600.0),
    )
    core.start()
    return core


def test_routing_done_while_opening_survives_a_kill_during_the_open(tmp_path, monkeypatch):
    """Found by the simulator (seed 297): recovery's checkpoint covers the messages whose
    routing it applies again; a kill before that routing was committed lost it."""

    async def main():
        core = _hourly(tmp_path / "live")
        await core.send_batch(_one(b"zero", 0))
        await core.create_subscription("low", filter="k < 5")
        await core.send_batch(_one(b"nine", 9))
        shutil.copytree(tmp_path / "live", tmp_path / "kill1")  # routing not committed
        await core.close()
        commit = QueueCore._commit_acks_now

        def kill_then_commit(self):
            shutil.copytree(self.broker.paging_directory, tmp_path / "kill2")
            commit(self)

        monkeypatch.setattr(QueueCore, "_commit_acks_now", kill_then_commit)
        core = _hourly(tmp_path / "kill1")  # killed again while opening
        monkeypatch.setattr(QueueCore, "_commit_acks_now", commit)
        await core.close()
        core = _hourly(tmp_path / "kill2")
        assert await drain(core, "low") == []
        await core.close()

    run(main())


def test_an_earliest_subscription_killed_before_its_start_gets_what_is_stored(tmp_path):
    """Found by the simulator: created "earliest" just before a kill (its file written,
    its starting set not), it got after recovery a message routed to no subscription."""

    async def main():
        core = _hourly(tmp_path / "live")
        await core.create_subscription("low", filter="k < 5")
        await core.send_batch(_one(b"nine", 9))  # routed nowhere: "low" rejects it
        await core.send_batch(_one(b"one", 1))
        flush = core.flush_acks

        async def kill_then_flush():
            shutil.copytree(tmp_path / "live", tmp_path / "killed")
            await flush()

        core.flush_acks = kill_then_flush
        await core.create_subscription("all", start="earliest")
        await core.close()
        core = _hourly(tmp_path / "killed")
        assert [s.name for s in core.list_subscriptions()] == ["low", "all"]
        assert await drain(core, "all") == [1]
        assert await drain(core, "low") == [1]
        await core.close()

    run(main())


def test_routing_in_an_ack_record_lost_to_rot_is_done_again(tmp_path):
    """Found by the simulator (seed 113): a damaged ack record took a filter's decisions
    with it; recovery applies every filter again from the start when records were lost."""

    async def main():
        core = _hourly(tmp_path)
        await core.create_subscription("all")
        await send(core, 5, "blue")
        red = await send(core, 5, "red", start=5)
        core.commits.last_checkpoint = -1e9
        await core.flush_acks()  # a checkpoint: routed_to 10
        await core.create_subscription("red", filter="color = 'red'", start="earliest")
        got = await core.fetch("c", 1, 0, 1, subscription="red")
        await core.ack("c", got.column("offset").to_numpy(), subscription="red")
        await core.close()
        logs = sorted(n for n in os.listdir(core.directory) if n.startswith("acks-"))
        path = os.path.join(core.directory, logs[-1])
        with open(path, "r+b") as f:  # its first record: "red"'s start and routing
            f.seek(60)
            byte = f.read(1)[0]
            f.seek(60)
            f.write(bytes([byte ^ 1]))
        core = _hourly(tmp_path)
        assert await drain(core, "red") == red[1:]
        await core.close()

    run(main())


def test_rot_that_makes_a_new_subscriptions_filter_reject_a_message_is_counted(tmp_path):
    """An "earliest" subscription's filter reads the stored properties without their
    record's CRC; a flipped bit made it reject a message it should get, which was
    acknowledged as routed away (a loss nobody counted). What it rejects is read
    checked first: the damaged record is quarantined and counted."""

    async def main():
        core = open_address(tmp_path)
        await core.create_subscription("all")
        await send(core, 5, "blue")
        await send(core, 1, "red", start=5)  # alone in its record
        red = await send(core, 5, "red", start=6)
        path = core.log.segment_of(5).path
        with open(path, "rb") as f:
            at = f.read().index(b"\xa3red")  # the first red's color, as msgpack packs it
        flip(path, at + 3)  # "red" -> "rec": the filter rejects it
        await core.create_subscription("red", filter="color = 'red'", start="earliest")
        got = await drain(core, "red")
        stats = core.stats()
        await core.close()
        return red, got, stats

    red, got, stats = run(main())
    assert got == red
    assert stats.damaged_messages == 1
