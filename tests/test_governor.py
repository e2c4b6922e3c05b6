"""The MemoryGovernor and the address-full policies, wired through a real local Ray."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
from raymq.actors.names import GOVERNOR_ACTOR_NAME

from raymq.errors import AddressFull

MIB = 2**20
KIB = 1024
#: A housekeeping period no test outlasts: the governor runs its first round when it
#: starts, then only the rounds a test asks for with ``rebalance()``, so the budgets a
#: test reads are those of the plan it holds. It is also the governor's wait for usage
#: answers, so a slow queue or consumer is waited for, not left out of the plan.
EXPLICIT_ROUNDS_ONLY = 3600.0
#: Bound on waiting for what must happen: only a wedge takes this long.
DEADLINE_SECONDS = 120.0


def fill(q, n: int, size: int = KIB, batch: int = 1000) -> None:
    for start in range(0, n, batch):
        q.send_batch(
            [i.to_bytes(8, "little") + b"x" * (size - 8) for i in range(start, start + batch)]
        )


def drain_ids(consumer, expected: int) -> list[int]:
    """Receive and ack until ``expected`` messages came or the queue has nothing more
    for ``consumer`` (backlog 0); returns the ids in the bodies."""
    ids: list[int] = []
    deadline = time.monotonic() + DEADLINE_SECONDS
    while len(ids) < expected:
        batch = consumer.receive_batch(1000, timeout=1)
        if batch.num_rows == 0:
            if consumer.backlog() == 0:
                break
        else:
            ids.extend(int.from_bytes(b[:8], "little") for b in batch.column("body").to_pylist())
            consumer.ack(batch)
        assert time.monotonic() < deadline, f"{len(ids)} of {expected} in {DEADLINE_SECONDS} s"
    return ids


def wait_loaded(consumer) -> None:
    """Wait until the consumer's loader holds its whole prefetch: its first fetch has
    landed (it now asks the governor for direct references sized by the messages it
    saw, not for its whole ``high_watermark_bytes``) and it fetches nothing more until
    something is taken, so its usage stays as it is; and the queue watches it (its
    TargetList's Ray registration, which a consumer not served yet puts off briefly,
    is what hands it to the governor)."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not _loaded_and_watched(consumer.stats(), consumer.prefetch):
        assert time.monotonic() < deadline, f"not loaded in {DEADLINE_SECONDS} s"
        time.sleep(0.05)


def _loaded_and_watched(stats: dict, prefetch: int) -> bool:
    return stats["watermark"] >= prefetch and stats["watched_by_queue"]


def test_budgets_follow_queue_size_and_reach_queues_and_consumers(broker_factory):
    broker = broker_factory(
        flow_to_disk_threshold=32 * MIB, housekeeping_period=EXPLICIT_ROUNDS_ONLY
    )
    big, small = broker.create_queue("big"), broker.create_queue("small")
    fill(big, 6000)
    fill(small, 2000)
    with big.consumer(prefetch=100) as cb, small.consumer(prefetch=100) as cs:
        wait_loaded(cb)
        wait_loaded(cs)
        plan = broker.rebalance()
        shares = {name: q["share"] for name, q in plan["queues"].items()}
        assert shares["big"] > shares["small"] > 0
        assert sum(shares.values()) <= 32 * MIB
        # Qpid: in proportion to size (both are above the floors here)
        assert shares["big"] / shares["small"] == pytest.approx(3.0, rel=0.1)
        for name, q in (("big", big), ("small", small)):
            assert q.stats()["memory_budget"] == plan["queues"][name]["queue_bytes"]
        for name, c in (("big", cb), ("small", cs)):
            direct = plan["queues"][name]["direct"][c.consumer_id]
            assert c.stats()["governor_budget"][0] == direct
            assert c.stats()["high_watermark_bytes"] == min(direct, 64 * MIB)
        stats = broker.governor_stats()
        assert stats["rounds"] >= 1 and set(stats["usage"]) == {"big", "small"}
        assert drain_ids(cb, 6000) == list(range(6000))


def test_transient_messages_flow_to_disk_under_the_threshold(broker_factory):
    broker = broker_factory(flow_to_disk_threshold=4 * MIB, housekeeping_period=0.5)
    q = broker.create_queue("transient", durable=False, page_size_bytes=MIB)
    broker.rebalance()
    fill(q, 12_000)  # ~12 MiB of transient messages, three times the whole threshold
    broker.rebalance()
    s = q.stats()
    assert 0 <= s["memory_budget"] <= 4 * MIB
    assert s["transient_bytes_in_memory"] <= s["memory_budget"]
    assert s["messages_flowed_to_disk"] > 0 and s["segment_files"] > 0
    with q.consumer(prefetch=1000) as c:
        assert drain_ids(c, 12_000) == list(range(12_000))


def test_governor_restart_keeps_budgets_and_finds_everyone_again(broker_factory):
    broker = broker_factory(
        flow_to_disk_threshold=16 * MIB, housekeeping_period=EXPLICIT_ROUNDS_ONLY
    )
    q = broker.create_queue("q")
    fill(q, 2000)
    with q.consumer(prefetch=50) as c:
        # A settled consumer: the restarted governor's first round, whenever it runs,
        # plans from the same usage and pushes the same budgets again.
        wait_loaded(c)
        before = broker.rebalance()["queues"]["q"]
        governor = ray.get_actor(GOVERNOR_ACTOR_NAME, namespace=broker.namespace)
        pid = ray.get(governor.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        # queues and consumers keep their last budgets while it is away
        assert q.stats()["memory_budget"] == before["queue_bytes"]
        assert c.stats()["governor_budget"][0] == before["direct"][c.consumer_id]
        after = broker.rebalance()  # retried until the restarted governor answers
        assert ray.get(governor.__ray_call__.remote(lambda self: os.getpid())) != pid
        assert c.consumer_id in after["queues"]["q"]["direct"]
        assert after["queues"]["q"]["share"] == pytest.approx(before["share"], rel=0.2)


def test_fail_and_block_reach_the_producer_as_address_full(broker):
    fail = broker.create_queue("fail", max_size_bytes=64 * KIB, address_full_policy="FAIL")
    fail.send_batch([b"x" * KIB] * 50)
    with pytest.raises(AddressFull, match="'fail'.*address_full_policy=FAIL"):
        fail.send_batch([b"x" * KIB] * 50)
    assert fail.stats()["depth"] == 50

    block = broker.create_queue("block", max_size_bytes=64 * KIB, address_full_policy="BLOCK")
    block.send_batch([b"x" * KIB] * 60)
    with pytest.raises(AddressFull, match="blocked"):
        block.send(b"y" * KIB * 8, timeout=0.3)
    done = threading.Event()
    result = {}

    def blocked_send():
        result["offset"] = block.send(b"z" * KIB * 8)
        done.set()

    t = threading.Thread(target=blocked_send)
    t.start()
    stats = block.stats()
    while stats["blocked_producers"] == 0:  # visible while it waits, with the reason
        assert not done.is_set()
        stats = block.stats()
    assert "max_size_bytes=65,536" in stats["blocked_reason"]
    with block.consumer(prefetch=20) as c:
        c.ack(c.receive(20, timeout=5))
    assert done.wait(10) and result["offset"] == 60
    t.join()

    drop = broker.create_queue("drop", max_size_bytes=64 * KIB, address_full_policy="DROP")
    stored = drop.send_batch([b"x" * KIB] * 100)
    assert 50 <= len(stored) < 64 and stored == list(range(len(stored)))
    assert drop.send(b"x" * KIB) is None
    assert drop.stats()["messages_dropped"] == 100 - len(stored) + 1


def _rounds_after(broker, started: float, rounds: int) -> dict:
    """Governor stats once ``rounds`` periodic rounds started after ``started`` (wall
    clock seconds) have finished."""
    first = None
    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        stats = broker.governor_stats()
        if stats["round_started"] > started:
            first = stats["rounds"] if first is None else first
            if stats["rounds"] - first >= rounds:
                return stats
        assert time.monotonic() < deadline, f"no {rounds} rounds in {DEADLINE_SECONDS} s"
        time.sleep(0.05)


def test_periodic_rounds_reuse_handles_and_find_a_queue_made_again(broker_factory):
    """A round looks up the broker, each queue actor and the nodes (GCS calls) only when
    it has none kept: once per queue, and the nodes every NODES_REFRESH_SECONDS; a queue
    deleted and made again (another actor) is found again by the next rounds."""
    from raymq.actors.governor_actor import NODES_REFRESH_SECONDS

    broker = broker_factory(housekeeping_period=0.1)
    broker.create_queue("q")
    before = _rounds_after(broker, time.time(), 2)
    t0 = time.monotonic()
    after = _rounds_after(broker, time.time(), 10)
    elapsed = time.monotonic() - t0
    # Asked anew every round, the broker, the queue and the nodes: 3 a round.
    assert after["lookups"] - before["lookups"] <= 1 + elapsed / NODES_REFRESH_SECONDS
    assert after["rounds"] - before["rounds"] >= 10
    broker.delete_queue("q")
    broker.create_queue("q")
    made = time.time()
    stats = _rounds_after(broker, made, 2)
    assert "q" in stats["usage"]  # from the new actor: the old one is gone
    assert "q" in stats["plan"]["queues"]
