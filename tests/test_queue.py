"""Queues on a real local Ray: round trips, competing consumers, redelivery, recovery."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import ray

import raymq
from raymq.client.calls import _call

DURABILITY = pytest.mark.parametrize("durable", [True, False], ids=["durable", "memory"])


#: Bound on receiving what a queue holds: only a wedge takes this long, not a slow machine.
DEADLINE_SECONDS = 120.0


def drain(consumer, expected: int) -> list:
    """Receive and ack until ``expected`` messages came or the queue has nothing more
    for ``consumer`` (its backlog is 0): an empty receive alone is no proof of that."""
    got = []
    deadline = time.monotonic() + DEADLINE_SECONDS
    while len(got) < expected:
        msgs = consumer.receive(max_messages=1000, timeout=1)
        if msgs:
            got.extend(msgs)
            consumer.ack(msgs)
        elif consumer.backlog() == 0:
            break
        assert time.monotonic() < deadline, f"{len(got)} of {expected} after {DEADLINE_SECONDS} s"
    return got


def receive_n(consumer, n: int) -> list:
    """Receive (without acking) until ``n`` messages came, however many receives that
    takes: a TargetList may load its credit in several fetches."""
    got = []
    deadline = time.monotonic() + DEADLINE_SECONDS
    while len(got) < n:
        got += consumer.receive(max_messages=n, timeout=1)
        assert time.monotonic() < deadline, f"{len(got)} of {n} after {DEADLINE_SECONDS} s"
    return got


@DURABILITY
def test_round_trip(broker, durable):
    q = broker.create_queue("rt", durable=durable)
    assert q.send(b"one", {"n": 1, "color": "red", "ok": True, "x": 1.5, "none": None}) == 0
    assert q.send_batch([b"two", b"three"], [{"n": 2}, {"n": 3}]) == [1, 2]
    table = pa.table({"body": [b"four", b"five"], "n": [4, 5], "tag": ["a", None]})
    assert q.send_batch(table) == [3, 4]
    with q.consumer() as c:
        msgs = c.receive(max_messages=10, timeout=5)
        assert [m.body for m in msgs] == [b"one", b"two", b"three", b"four", b"five"]
        assert msgs[0].properties == {"n": 1, "color": "red", "ok": True, "x": 1.5, "none": None}
        assert msgs[4].properties == {"n": 5}
        assert [m.delivery_count for m in msgs] == [1] * 5
        assert all(m.timestamp > 1e9 for m in msgs)
        assert c.ack(msgs, wait=True) == 5
    stats = q.stats()
    assert stats["depth"] == 0 and stats["messages_in"] == 5
    # A durable queue keeps its newest segment (it names the highest offset given).
    assert stats["segment_files"] == (1 if durable else 0)


def test_receive_batch_is_arrow_and_receive_times_out(broker):
    q = broker.create_queue("arrow")
    q.send_batch([b"x" * 1024] * 500)
    with q.consumer(prefetch=500) as c:
        # A receive gives what is ready, up to its max: a new consumer's first fetch is
        # small (slow start), so the 500 may come in a few batches, in order.
        parts = []
        while sum(p.num_rows for p in parts) < 500:
            batch = c.receive_batch(500 - sum(p.num_rows for p in parts), timeout=30)
            assert isinstance(batch, pa.RecordBatch) and batch.num_rows > 0
            parts.append(batch)
        offsets = [o for p in parts for o in p.column("offset").to_pylist()]
        assert offsets == list(range(500))
        for batch in parts:
            c.ack(batch)
        empty = c.receive_batch(10, timeout=0.2)
        assert empty.num_rows == 0
        assert c.receive(timeout=0.1) == []


def test_competing_consumers_get_distinct_messages(broker):
    q = broker.create_queue("compete")
    q.send_batch([str(i).encode() for i in range(3000)])
    consumers = [q.consumer(prefetch=100) for _ in range(3)]
    seen = [[] for _ in consumers]
    idle_rounds = 0
    # Until everything came, or no consumer got anything for 50 rounds of 0.6 s.
    while sum(map(len, seen)) < 3000 and idle_rounds < 50:
        idle_rounds += 1
        for i, c in enumerate(consumers):
            msgs = c.receive(max_messages=100, timeout=0.2)
            if msgs:
                idle_rounds = 0
                seen[i].extend(m.offset for m in msgs)
                c.ack(msgs)
    all_offsets = [o for s in seen for o in s]
    assert sorted(all_offsets) == list(range(3000))
    assert len(set(all_offsets)) == 3000
    assert all(len(s) > 0 for s in seen)
    for s in seen:
        assert s == sorted(s)  # one consumer sees its messages in offset order
    for c in consumers:
        c.close()


@DURABILITY
def test_redelivery_after_nack_and_close(broker, durable):
    q = broker.create_queue("redeliver", durable=durable)
    q.send_batch([b"a", b"b", b"c"])
    c1 = q.consumer()
    msgs = c1.receive(max_messages=3, timeout=5)
    c1.nack(msgs[0])
    again = c1.receive(max_messages=3, timeout=5)
    assert [(m.offset, m.delivery_count) for m in again] == [(0, 2)]
    c1.ack(msgs[1])
    c1.close()  # holds 0 (twice delivered) and 2
    with pytest.raises(raymq.errors.ConsumerClosed):
        c1.receive()
    with q.consumer() as c2:
        rest = c2.receive(max_messages=3, timeout=5)
        assert [(m.offset, m.body, m.delivery_count) for m in rest] == [(0, b"a", 3), (2, b"c", 2)]
        c2.ack(rest)


def test_prefetch_bounds_what_a_consumer_holds(broker):
    q = broker.create_queue("prefetch")
    q.send_batch([b"m"] * 50)
    with q.consumer(prefetch=10) as c:
        first = receive_n(c, 10)
        assert len(first) == 10  # not more: 10 is all its credit
        assert c.receive(max_messages=50, timeout=0.2) == []  # no credit left
        # Only now the second consumer: had it come first, it could take all 50.
        with q.consumer(prefetch=100) as other:
            assert len(receive_n(other, 40)) == 40
            assert other.backlog() == 0  # the 10 c holds are not for it
            c.ack(first[:5])
            assert len(c.receive(max_messages=50, timeout=0.2)) == 0  # the other holds the rest


def test_prefetched_but_not_received_is_not_counted_as_delivered(broker):
    q = broker.create_queue("prefetched")
    q.send_batch([b"p"] * 5)
    c = q.consumer(prefetch=5)
    assert len(c.receive(max_messages=1, timeout=5)) == 1  # 4 more sit in the buffer
    c.close()
    with q.consumer() as c2:
        counts = sorted((m.offset, m.delivery_count) for m in c2.receive(5, timeout=5))
        assert counts == [(0, 2), (1, 1), (2, 1), (3, 1), (4, 1)]


def test_concurrent_single_sends_are_coalesced(broker):
    q = broker.create_queue("coalesce")
    results: list[int] = []
    lock = threading.Lock()

    def produce(k):
        for i in range(50):
            off = q.send(f"{k}-{i}".encode())
            with lock:
                results.append(off)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(400))
    with q.consumer() as c:
        bodies = {m.offset: m.body for m in drain(c, 400)}
    assert len(bodies) == 400


def test_queue_survives_broker_restart(broker_factory, paging_dir):
    b1 = broker_factory()
    q = b1.create_queue("persist")
    q.send_batch([f"m{i}".encode() for i in range(100)])
    with q.consumer() as c:
        c.ack(c.receive(max_messages=30, timeout=5))
    b1.shutdown()
    b2 = broker_factory()
    assert b2.list_queues() == ["persist"]
    q2 = b2.get_queue("persist")
    with q2.consumer() as c:
        got = drain(c, 70)
    assert [m.body for m in got] == [f"m{i}".encode() for i in range(30, 100)]


def kill_mid_stream(q, producers, sent: dict, stop, *, before: int, after: int) -> None:
    """Start ``producers``; once ``before`` sends were acknowledged (in ``sent``),
    SIGKILL the queue actor's process; once ``after`` more were acknowledged by its
    restarted actor, stop the producers (``stop``) and wait for them."""
    for t in producers:
        t.start()
    while len(sent) < before:
        stop.wait(0.01)
    pid = _call(q._actor.pid)
    os.kill(pid, signal.SIGKILL)
    before_kill = len(sent)
    while len(sent) < before_kill + after:  # the restarted actor takes sends again
        stop.wait(0.01)
    stop.set()
    for t in producers:
        t.join()
    assert _call(q._actor.pid) != pid


def test_sigkill_of_the_queue_actor_loses_no_acknowledged_send(broker):
    q = broker.create_queue("crash", page_size_bytes=256 * 1024)
    sent: dict[int, bytes] = {}
    stop = threading.Event()
    errors: list[Exception] = []

    def produce():
        i = 0
        while not stop.is_set():
            bodies = [f"crash-{i}-{j}".encode() * 10 for j in range(100)]
            try:
                offsets = q.send_batch(bodies)
            except Exception as exc:  # a send cut by the crash may fail; it was not acknowledged
                errors.append(exc)
                continue
            sent.update(zip(offsets, bodies, strict=True))
            i += 1

    kill_mid_stream(q, [threading.Thread(target=produce)], sent, stop, before=5000, after=3000)
    with q.consumer(prefetch=5000) as c:
        got = {}
        deadline = time.monotonic() + DEADLINE_SECONDS
        # Until every acknowledged send came, or the queue has nothing more (backlog 0):
        # an empty receive alone may be a slow restart, not the end.
        while not sent.keys() <= got.keys():
            batch = c.receive_batch(5000, timeout=1)
            if batch.num_rows == 0:
                if c.backlog() == 0:
                    break
                assert time.monotonic() < deadline, f"{len(got)} received in {DEADLINE_SECONDS} s"
                continue
            got.update(
                zip(
                    batch.column("offset").to_pylist(),
                    batch.column("body").to_pylist(),
                    strict=True,
                )
            )
            c.ack(batch)
    missing = [o for o in sent if o not in got]
    assert not missing, f"{len(missing)} acknowledged sends lost, e.g. {missing[:5]}"
    assert all(got[o] == body for o, body in sent.items())


def test_single_sends_go_over_the_send_channel_and_survive_a_sigkill(broker):
    from raymq.client import send_channels as client
    from raymq.wire.send import SendChannel

    q = broker.create_queue("crash-single")

    def channel() -> SendChannel | None:
        found = [
            c for c in client._channels.values() if isinstance(c, SendChannel) and c.queue == q.name
        ]
        return found[-1] if found else None

    assert q.send(b"first") == 0
    first_channel = channel()
    assert first_channel is not None and first_channel.broken is None
    sent: dict[int, bytes] = {0: b"first"}
    lock = threading.Lock()
    stop = threading.Event()

    def produce(k: int) -> None:
        i = 0
        while not stop.is_set():
            body = f"single-{k}-{i}".encode()
            i += 1
            try:
                offset = q.send(body)
            except Exception:  # a send cut by the crash: not acknowledged, may be stored
                continue
            with lock:
                sent[offset] = body

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    kill_mid_stream(q, threads, sent, stop, before=500, after=500)
    assert first_channel.broken is not None  # the old connection died with the actor
    q.send(b"after")  # opens a channel to the restarted actor (or waits out the retry)
    with q.consumer(prefetch=5000) as c:
        got = {m.offset: m.body for m in drain(c, q.stats()["depth"])}
    missing = [o for o in sent if o not in got]
    assert not missing, f"{len(missing)} acknowledged sends lost, e.g. {missing[:5]}"
    assert all(got[o] == body for o, body in sent.items())


def test_delete_queue_removes_files(broker_factory, paging_dir):
    broker = broker_factory()  # its files are in paging_dir
    q = broker.create_queue("gone")
    q.send(b"x")
    assert os.path.isdir(os.path.join(paging_dir, "gone"))
    broker.delete_queue("gone")
    assert not os.path.exists(os.path.join(paging_dir, "gone"))
    assert broker.list_queues() == []
    with pytest.raises(raymq.errors.QueueNotFound):
        broker.get_queue("gone")


def test_segment_files_deleted_when_acked(broker_factory, paging_dir):
    broker = broker_factory()  # its files are in paging_dir
    q = broker.create_queue("pages", page_size_bytes=64 * 1024)
    for _ in range(8):
        q.send_batch([b"s" * 1000] * 50)
    stats = q.stats()
    assert stats["segment_files"] >= 8
    with q.consumer(prefetch=10_000) as c:
        drain(c, 400)
    assert q.stats()["segment_files"] == 1  # the newest stays, naming the highest offset
    left = [f for f in os.listdir(os.path.join(paging_dir, "pages")) if f.endswith(".seg")]
    assert len(left) == 1 and int(left[0][:-4]) > 0


def test_ack_of_foreign_or_unknown_offsets_is_refused(broker):
    q = broker.create_queue("acks")
    q.send_batch([b"a", b"b"])
    with q.consumer(prefetch=1) as c1, q.consumer(prefetch=1) as c2:
        m1 = c1.receive(timeout=5)
        m2 = c2.receive(timeout=5)
        with pytest.raises(raymq.errors.InvalidAck):
            c1.ack(m2, wait=True)
        with pytest.raises(raymq.errors.InvalidAck):
            c1.ack([m1[0].offset, 99], wait=True)
        assert q.stats()["depth"] == 2  # nothing changed
        assert c1.ack(m1, wait=True) == 1
        with pytest.raises(TypeError):
            c1.ack("0")


def test_waited_acks_nacks_and_rejects_go_over_the_send_channel_then_ray_if_it_broke(broker):
    """On a real queue actor: ``ack(wait=True)``, ``nack`` and ``reject`` are answered
    on the process's SendChannel once it is open (counted), with their effects; after
    that connection broke they go through Ray with the same effects."""
    from raymq.client.send_channels import _channel_key, _open_channel

    q = broker.create_queue("settle", redelivery_delay_s=0)
    q.send_batch([b"a", b"b", b"c", b"d", b"e"])
    q.send(b"f")  # opens this process's SendChannel to the queue's actor
    channel = _open_channel(_channel_key(q))
    assert channel is not None
    with q.consumer(prefetch=10) as c:
        got = {m.body: m for m in c.receive(max_messages=6, timeout=10)}
        while len(got) < 6:
            got.update({m.body: m for m in c.receive(max_messages=6, timeout=10)})
        assert c.ack(got[b"a"], wait=True) == 1
        assert c.nack(got[b"b"], delay=0) == 1
        assert c.reject(got[b"c"]) == 1
        with pytest.raises(raymq.errors.InvalidAck):  # refused typed, the channel goes on
            c.ack(got[b"a"].offset + 100, wait=True)
        with pytest.raises(raymq.errors.InvalidSetting, match="delay"):
            c.nack(got[b"d"], delay=-1)
        assert c.calls_over_wire == 3 and channel.broken is None
        assert c.stats()["calls_over_wire"] == 3 and c.stats()["calls_in_doubt"] == 0
        again = c.receive(timeout=10)
        assert [(m.body, m.delivery_count) for m in again] == [(b"b", 2)]

        channel.close()  # broken: the next call goes through Ray, a new one opens
        deadline = time.monotonic() + 10
        while channel.broken is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.nack(got[b"d"], delay=0) == 1
        assert c.calls_over_wire == 3  # not over the broken channel
        while _open_channel(_channel_key(q)) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # opened meanwhile, in the background
        assert c.reject(got[b"e"]) == 1
        assert c.ack(again, wait=True) == 1
        assert c.calls_over_wire == 5  # over the new channel
        assert [(m.body, m.delivery_count) for m in c.receive(timeout=10)] == [(b"d", 2)]
    deadline = time.monotonic() + 30
    while q.stats()["messages_dead_lettered"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    dlq = broker.get_queue("settle.DLQ")
    with dlq.consumer() as d:
        dead = sorted(m.body for m in d.receive(max_messages=10, timeout=10))
        while len(dead) < 2:
            dead += [m.body for m in d.receive(max_messages=10, timeout=10)]
    assert sorted(dead) == [b"c", b"e"]


def test_actor_layout(broker):
    q = broker.create_queue("layout")
    names = {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == broker.namespace
    }
    assert names == {"raymq.broker", "raymq.governor", "raymq.queue.layout"}
    assert np.int64(q.send(b"x")) == 0


def test_pipelined_acks_are_durable_after_flush_and_report_errors(broker):
    q = broker.create_queue("pipelined")
    q.send_batch([b"x" * 100] * 5000)
    with q.consumer(prefetch=2000) as c:
        got = 0
        while got < 5000:
            batch = c.receive_batch(500, timeout=5)
            assert batch.num_rows
            assert c.ack(batch, wait=False) is None
            got += batch.num_rows
        c.flush()
        assert q.stats()["depth"] == 0 and q.stats()["messages_acked"] == 5000
        c.ack([10**9], wait=False)  # never sent: the error comes with the next check
        with pytest.raises(raymq.errors.InvalidAck, match="never sent"):
            c.flush()


def test_a_refused_pipelined_ack_does_not_take_the_gathered_ones_with_it(broker):
    q = broker.create_queue("gathered")
    q.send_batch([b"m"] * 100)
    with q.consumer(prefetch=1000) as c:  # pipelined acks gather until 500 or a flush
        batches = []
        while sum(b.num_rows for b in batches) < 100:
            batches.append(c.receive_batch(100, timeout=5))
            assert batches[-1].num_rows
        c.ack(batches[0], wait=False)
        c.ack([10**9], wait=False)  # never delivered: refused
        for b in batches[1:]:
            c.ack(b, wait=False)
        with pytest.raises(raymq.errors.InvalidAck, match="never sent"):
            c.flush()
        stats = q.stats()
        assert stats["messages_acked"] == 100 and stats["depth"] == 0
