"""Many queues per node on real Ray: hibernation under a small cap, revival through old
handles, nothing lost (the policy's arithmetic is in test_hibernation.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray
from raymq.actors.names import queue_actor_name

from raymq.client.calls import _call


def _running(broker, name: str) -> bool:
    try:
        ray.get_actor(queue_actor_name(name), namespace=broker.namespace)
    except ValueError:
        return False
    return True


def _receive_all(queue, n: int) -> list[bytes]:
    with queue.consumer(prefetch=100) as consumer:
        got = []
        while len(got) < n:
            batch = consumer.receive(n - len(got), timeout=30)
            assert batch, f"queue {queue.name!r}: {len(got)} of {n} messages"
            got += batch
            consumer.ack(batch)  # credit for the next: prefetch bounds what is unacked
    return [m.body for m in got]


def test_five_queues_under_a_cap_of_two_lose_nothing(broker):
    broker.set_hibernation(max_active_queues=2, hibernate_after_seconds=None)
    queues = []
    for i in range(5):
        q = broker.create_queue(f"q{i}")
        q.send_batch([f"{i}-{j}".encode() for j in range(3)])
        queues.append(q)
    stats = broker.hibernation_stats()
    assert sum(stats["active_per_node"].values()) <= 2
    assert len(stats["hibernated"]) >= 3 and stats["over_cap"] == 0
    assert sum(_running(broker, f"q{i}") for i in range(5)) <= 2
    states = {n: s["state"] for n, s in broker.stats().items()}
    assert sorted(n for n, s in states.items() if s == "hibernated") == stats["hibernated"]

    # Old handles of hibernated queues: calls revive them, sends and messages are kept.
    for i, q in enumerate(queues):
        assert q.stats()["depth"] == 3
        q.send_batch([f"{i}-3".encode()])
        fresh = broker.get_queue(f"q{i}")
        assert sorted(_receive_all(fresh, 4)) == [f"{i}-{j}".encode() for j in range(4)]
    stats = broker.hibernation_stats()
    assert stats["revivals"] >= 3 and sum(stats["active_per_node"].values()) <= 2


def test_queues_created_side_by_side_keep_the_cap_and_their_messages(broker):
    # The broker starts their processes side by side; each makes room under a per-node
    # lock and counts from then on, so that starts together do not hibernate the same
    # idle queue twice, and a node they took over its cap is brought back under it
    # (a queue handed out is not trimmed before its client's first call: test_hibernator).
    broker.set_hibernation(max_active_queues=2, hibernate_after_seconds=None)

    def create(i: int) -> str:
        q = broker.create_queue(f"side{i}")
        q.send_batch([f"{i}-{j}".encode() for j in range(2)])
        return q.name

    with ThreadPoolExecutor(6) as pool:
        names = list(pool.map(create, range(6)))
    # Starts that overlapped pass the cap (counted); idle queues then hibernate.
    # (The broker's count of running queues follows the actors' states a moment later:
    # both are waited for, under a loaded machine too.)
    deadline = time.monotonic() + 60

    def over_the_cap() -> bool:
        running = sum(_running(broker, n) for n in names)
        counted = sum(broker.hibernation_stats()["active_per_node"].values())
        return (running > 2 or counted > 2) and time.monotonic() < deadline

    while over_the_cap():
        time.sleep(0.05)  # polling a condition, with a deadline
    stats = broker.hibernation_stats()
    assert sum(stats["active_per_node"].values()) <= 2, stats
    assert sum(_running(broker, n) for n in names) <= 2, stats
    for i, name in enumerate(names):
        got = _receive_all(broker.get_queue(name), 2)
        assert sorted(got) == [f"{i}-{j}".encode() for j in range(2)]


def test_a_queue_handed_out_over_the_cap_is_not_trimmed_before_its_first_call(broker):
    """The race behind the revert of the side-by-side starts (cc976df): a queue started
    over the cap (the queue filling it busy) looked idle to the trimmer until its
    client's first call, and was hibernated under it; its client followed, revived it
    over the cap again, and so on (tests/test_hibernator.py replays it without Ray)."""
    broker.set_hibernation(max_active_queues=1, hibernate_after_seconds=None)
    holder = broker.create_queue("holder")
    holder.send(b"held")
    with holder.consumer(prefetch=1) as c:
        assert c.receive(1, timeout=30)  # delivered, not acknowledged: busy
        late = broker.create_queue("late")  # over the cap: the trimmer starts
        given = late._actor
        time.sleep(1.0)  # a slow client: the trimmer sweeps meanwhile
        assert _running(broker, "late"), broker.hibernation_stats()
        late.send(b"x")  # reaches the actor it was given
        assert late._actor is given and late._link.stats().follows == 0
        # Called, it may go (the node is over its cap): its next call follows it once,
        # where it was hibernated again before each of its calls, for the link's whole
        # grace (60 s, 41 revivals measured without the fix).
        deadline = time.monotonic() + 30
        while _running(broker, "late") and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a condition, with a deadline
        late.send(b"y")
        assert late._link.stats().follows <= 2, late._link.stats()
    assert sorted(_receive_all(broker.get_queue("late"), 2)) == [b"x", b"y"]


def test_busy_queues_do_not_hibernate_and_idle_ones_do_after_the_timeout(broker):
    busy = broker.create_queue("busy")
    idle = broker.create_queue("idle")
    busy.send(b"held")
    consumer = busy.consumer(prefetch=10)
    try:
        assert consumer.receive(1, timeout=30)  # delivered, not acknowledged
        assert not broker.hibernate("busy")
        # Longer than the governor's housekeeping period (1 s): its rounds of calls to
        # every queue do not count as use.
        broker.set_hibernation(max_active_queues=None, hibernate_after_seconds=1.5)
        idle.send(b"kept")
        # The sweep (every 0.75 s here) hibernates "idle"; "busy" stays however long.
        deadline = time.monotonic() + 60
        stats = broker.hibernation_stats()
        while "idle" not in stats["hibernated"] and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a condition, with a deadline
            stats = broker.hibernation_stats()
        assert "idle" in stats["hibernated"], stats
        assert "busy" not in stats["hibernated"] and _running(broker, "busy")
    finally:
        consumer.close()
    broker.set_hibernation(max_active_queues=None, hibernate_after_seconds=None)
    assert _receive_all(broker.get_queue("idle"), 1) == [b"kept"]


def test_a_transient_queue_with_messages_stays_running_a_redelivered_message_does_not(
    broker,
):
    """What a new process would not have keeps a queue running: a transient queue's
    messages (its files are emptied at a start). A durable queue's delivery counts are
    on disk: its redelivered message hibernates with it and comes back counted."""
    transient = broker.create_queue("transient", durable=False)
    transient.send_batch([b"a", b"b", b"c"])
    redelivered = broker.create_queue("redelivered", max_delivery_attempts=3)
    redelivered.send(b"poison")
    with redelivered.consumer(prefetch=1) as consumer:
        consumer.nack(consumer.receive(1, timeout=30))
    assert not broker.hibernate("transient")
    assert transient.stats()["depth"] == 3
    assert broker.hibernate("redelivered") and not _running(broker, "redelivered")
    with redelivered.consumer(prefetch=1) as consumer:
        (again,) = consumer.receive(1, timeout=30)
        assert again.delivery_count == 2
        consumer.ack([again])
    assert _running(broker, "redelivered")


def test_a_consumer_its_queue_dropped_starts_the_hibernated_queue_again(broker):
    """A queue drops a consumer it takes for dead (as when Ray answers its death watch
    "unavailable"); idle then, it hibernates. The consumer lives on, and nobody else
    calls the queue: its next fetch has the broker start the queue again."""
    q = broker.create_queue("dropped")
    q.send_batch([b"a", b"b"])
    with q.consumer(prefetch=1) as c:
        deadline = time.monotonic() + 60
        held = 0
        while not held and time.monotonic() < deadline:  # its TargetList loads eagerly
            held = ray.get(q._actor.consumer_stats.remote(c.consumer_id)).get("held", 0)
            time.sleep(0.05)  # polling a condition, with a deadline
        assert held == 1  # prefetch=1: offset 0, given back uncounted (never received)
        held = np.arange(held, dtype=np.int64)
        ray.get(q._actor.close_consumer.remote(c.consumer_id, held))
        assert broker.hibernate("dropped") and not _running(broker, "dropped")
        # Receives only (an ack would go through the client's handle, which revives
        # the queue itself). The first is the message its TargetList held; a second
        # can only come from the queue started again, which knows nothing of the
        # first delivery: offset 0 again (at-least-once).
        got: list[bytes] = []
        deadline = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            got += [m.body for m in c.receive(2, timeout=10)]
        assert got == [b"a", b"a"], got
    assert _running(broker, "dropped")


def test_a_consumer_whose_queue_actor_was_ended_acks_to_the_new_one(broker):
    """The queue's actor is ended for good under a living consumer (an operator's
    ``ray kill``, say): its TargetList has the broker start the queue again, and its
    pipelined acks follow to the new actor, where they went on failing on the old
    handle (counted as lost) until the consumer stalled at its prefetch."""
    q = broker.create_queue("ended")
    q.send_batch([str(i).encode() for i in range(50)])
    with q.consumer(prefetch=10) as c:
        first = c.receive(5, timeout=30)
        c.ack(first, wait=True)
        ray.kill(q._actor, no_restart=True)
        got = {m.body for m in first}
        deadline = time.monotonic() + 90
        while len(got) < 50 and time.monotonic() < deadline:
            batch = c.receive(10, timeout=5)
            got |= {m.body for m in batch}
            c.ack(batch)
        c.flush()
    assert len(got) == 50, sorted(got)
    assert q.stats()["depth"] == 0


def test_a_queue_written_only_over_its_send_channel_is_not_idle(broker):
    """Sends travel over the queue's SendChannel, not Ray calls: they count as use."""
    fed = broker.create_queue("fed")
    idle = broker.create_queue("idle")
    fed.send(b"0")  # the channel is open from here on
    broker.set_hibernation(max_active_queues=None, hibernate_after_seconds=1.5)
    idle.send(b"kept")
    # Sends until "idle" hibernated and at least four timeouts passed: "fed" is never
    # idle meanwhile, however long the sweep takes to hibernate "idle".
    sent, start = 1, time.monotonic()
    deadline = start + 60
    while True:
        fed.send(str(sent).encode())
        sent += 1
        time.sleep(0.05)  # a producer's pace: a send every 50 ms
        if sent % 5:
            continue
        stats = broker.hibernation_stats()
        assert "fed" not in stats["hibernated"], stats
        if "idle" in stats["hibernated"] and time.monotonic() - start >= 4 * 1.5:
            break
        assert time.monotonic() < deadline, stats  # the sweep must run meanwhile
    assert stats["revivals"] == 0, stats
    broker.set_hibernation(max_active_queues=None, hibernate_after_seconds=None)
    assert _receive_all(fed, sent) == [str(i).encode() for i in range(sent)]


def test_async_sends_through_ray_calls_follow_a_hibernated_queue(broker):
    """``send_async``/``send_batch_async`` without a SendChannel (it could not connect)
    go through Ray calls that follow the queue to its revived actor, as ``send`` does."""
    from raymq.client import send_channels as client

    q = broker.create_queue("asleep")
    key = (ray.get_runtime_context().get_job_id(), q._actor._actor_id.hex())
    client._channels[key] = time.monotonic() + 3600  # as after a failed connect
    q.send(b"0")
    assert broker.hibernate("asleep")

    async def sends():
        return await q.send_async(b"1"), await q.send_batch_async([b"2", b"3"])

    assert asyncio.run(sends()) == (1, [2, 3])
    assert broker.hibernation_stats()["revivals"] == 1
    assert _receive_all(broker.get_queue("asleep"), 4) == [b"0", b"1", b"2", b"3"]


def test_a_hibernated_queue_survives_a_killed_broker(broker):
    q = broker.create_queue("sleeper")
    q.send_batch([b"a", b"b"])
    assert broker.hibernate("sleeper") and not _running(broker, "sleeper")
    pid = _call(broker._actor.pid)
    os.kill(pid, signal.SIGKILL)
    while _call(broker._actor.pid) == pid:  # a call may still reach the dying process
        pass
    assert q.stats()["depth"] == 2  # the old handle: revived by the restarted broker
    assert sorted(_receive_all(broker.get_queue("sleeper"), 2)) == [b"a", b"b"]


def test_a_queue_left_hibernating_by_a_dead_broker_is_started_anew(broker):
    q = broker.create_queue("limbo")
    q.send_batch([b"a", b"b"])
    assert _call(q._actor.hibernate)  # closed, as by a broker that died before its kill
    pid = _call(broker._actor.pid)
    os.kill(pid, signal.SIGKILL)
    while _call(broker._actor.pid) == pid:  # a call may still reach the dying process
        pass
    assert q.stats()["depth"] == 2  # NotLeader from the closed actor: the broker replaces it
    assert sorted(_receive_all(broker.get_queue("limbo"), 2)) == [b"a", b"b"]


def test_deleting_a_hibernated_queue_does_not_start_it(broker):
    q = broker.create_queue("deleted-asleep")
    q.send_batch([b"a", b"b"])
    directory = os.path.join(broker.config.paging_directory, "deleted-asleep")
    assert broker.hibernate("deleted-asleep") and not _running(broker, "deleted-asleep")
    assert os.listdir(directory)
    revivals = broker.hibernation_stats()["revivals"]
    broker.delete_queue("deleted-asleep")
    assert broker.hibernation_stats()["revivals"] == revivals  # not started to be deleted
    assert not _running(broker, "deleted-asleep") and not os.path.exists(directory)
    assert "deleted-asleep" not in broker.list_queues()
    assert broker.create_queue("deleted-asleep").stats()["depth"] == 0  # a new, empty one


def test_deleting_a_queue_left_hibernating_by_its_broker_ends_its_actor(broker):
    """Closed for a hibernation the broker did not finish, the actor answers NotLeader,
    its shutdown too: it is ended, and its files deleted all the same."""
    q = broker.create_queue("deleted-limbo")
    q.send_batch([b"a"])
    assert _call(q._actor.hibernate)  # closed, not ended
    broker.delete_queue("deleted-limbo")
    assert not _running(broker, "deleted-limbo")
    assert not os.path.exists(os.path.join(broker.config.paging_directory, "deleted-limbo"))
    assert "deleted-limbo" not in broker.list_queues()


def test_a_consumer_made_through_an_old_handle_of_a_hibernated_queue_receives(broker):
    q = broker.create_queue("old-handle")
    q.send(b"kept")
    assert broker.hibernate("old-handle") and not _running(broker, "old-handle")
    with q.consumer() as c:  # the handle's actor is gone: it follows the queue first
        got = c.receive(timeout=30)
        assert [m.body for m in got] == [b"kept"]
        c.ack(got, wait=True)
    assert q.stats()["depth"] == 0


def test_a_handle_remembers_the_fetch_channel_and_asks_again_once_it_is_stale(broker):
    q = broker.create_queue("remembered")
    q.send_batch([b"a", b"b"])
    asked = []
    invoke = q._invoke
    q._invoke = lambda method, *args: asked.append(method) or invoke(method, *args)
    for _ in range(2):  # the second consumer costs no call to the queue: remembered
        with q.consumer() as c:
            c.ack(c.receive(timeout=30), wait=True)
    assert asked.count("fetch_endpoint") == 1
    q.send_batch([b"c", b"d"])
    old = q._fetch_endpoint_of
    assert broker.hibernate("remembered") and not _running(broker, "remembered")
    with q.consumer() as c:  # the remembered channel is the old actor's: asked again
        got = list(c.receive(2, timeout=30))
        while len(got) < 2:
            more = c.receive(2 - len(got), timeout=30)
            assert more, f"{len(got)} of 2 messages"
            got += more
        assert sorted(m.body for m in got) == [b"c", b"d"]
        c.ack(got, wait=True)
        stats = c.stats()
    assert asked.count("fetch_endpoint") == 2 and q._fetch_endpoint_of != old
    assert stats["fetch_channel"] and stats["fetch_channel_failures"] == 0
    assert q.stats()["depth"] == 0
