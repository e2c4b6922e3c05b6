"""Calls made while a queue actor restarts wait for it (real SIGKILLs on a local Ray)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pyarrow as pa
import pytest
import ray
from raymq.actors.names import BROKER_ACTOR_NAME

from raymq.client.calls import _call
from raymq.errors import BrokerUnavailable, InvalidSetting


def test_get_queue_right_after_a_kill_waits_for_the_restart(broker):
    q = broker.create_queue("phoenix")
    q.send(b"before")
    pid = _call(q._actor.pid)
    os.kill(pid, signal.SIGKILL)
    again = broker.get_queue("phoenix")  # the broker actor's ready() call meets the death
    assert _call(again._actor.pid) != pid
    assert again.send(b"after") == 1
    assert [m.body for m in again.browse()] == [b"before", b"after"]


def test_a_queue_whose_node_is_gone_starts_here_only_with_its_files(broker_factory, paging_dir):
    broker = broker_factory()  # its files are in paging_dir
    for name in ("moved", "lost"):
        broker.create_queue(name).send(name.encode())
        ray.kill(broker.get_queue(name)._actor, no_restart=True)
        meta = os.path.join(paging_dir, name, "queue.json")
        with open(meta) as f:
            saved = json.load(f)
        saved["node_id"] = "ff" * 28  # a node that is not alive
        with open(meta, "w") as f:
            json.dump(saved, f)
    # The broker actor restarts and reads the registry again from the files.
    registry = ray.get_actor(BROKER_ACTOR_NAME, namespace=broker.namespace)
    pid = _call(registry.pid)
    os.kill(pid, signal.SIGKILL)
    while _call(registry.pid) == pid:  # a call may still reach the dying process
        pass
    os.rename(os.path.join(paging_dir, "lost"), os.path.join(paging_dir, "elsewhere"))
    assert [m.body for m in broker.get_queue("moved").browse()] == [b"moved"]
    with open(os.path.join(paging_dir, "moved", "queue.json")) as f:
        assert json.load(f)["node_id"] == ray.get_runtime_context().get_node_id()
    with pytest.raises(BrokerUnavailable, match="'lost' lives on node ffffffffffff"):
        broker.get_queue("lost")  # never started empty where its files are not


def test_a_paused_queue_does_not_hang_the_brokers_stop(broker):
    """A queue actor that cannot answer (its process paused) is ended after the stop's
    timeout; the queues before and after it are stopped as usual and keep their data."""
    import time

    for name in ("a-before", "b-paused", "c-after"):
        broker.create_queue(name).send(name.encode())
    for wrong in (0, -1, None, "1"):  # refused before anything stops
        with pytest.raises(ValueError, match="timeout must be seconds > 0"):
            broker.shutdown(timeout=wrong)
    paused = _call(broker.get_queue("b-paused")._actor.pid)
    os.kill(paused, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        broker.shutdown(timeout=1.0)
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):  # ended by the stop already
            os.kill(paused, signal.SIGCONT)
    assert took < 30, took  # about the 1 s timeout, not for ever
    again = _connect_again(broker)
    assert [[m.body for m in again.get_queue(n).browse()] for n in ("a-before", "c-after")] == [
        [b"a-before"],
        [b"c-after"],
    ]
    assert [m.body for m in again.get_queue("b-paused").browse()] == [b"b-paused"]
    again.shutdown()


def _connect_again(broker):
    """A broker over the same namespace and paging directory as a stopped one."""
    import raymq

    return raymq.connect(
        namespace=broker.namespace, paging_directory=broker.config.paging_directory
    )


def test_a_consumer_is_watched_again_by_a_queue_restarted_in_place(broker):
    """A queue actor restarted after a crash learns of a living consumer from its next
    fetch; it must also get the consumer's handle back, to watch for its death (else
    what a consumer that dies later held stays held until the queue restarts again).
    Here the consumer's TargetList is full while the queue restarts: its next fetch
    finds the FetchChannel broken and the actor already up again."""
    q = broker.create_queue("watched-again")
    q.send_batch([b"before", b"held"])
    with q.consumer(prefetch=1) as c:
        c.ack(c.receive(1, timeout=30), wait=True)
        deadline = time.monotonic() + 60
        side: dict = {}
        while side.get("delivered") != 2 and time.monotonic() < deadline:
            side = _call(q._actor.consumer_stats, c.consumer_id)  # "held" loaded eagerly
            time.sleep(0.02)  # polling a condition, with a deadline
        assert side["delivered"] == 2, side
        os.kill(_call(q._actor.pid), signal.SIGKILL)
        assert q.stats()["depth"] == 1  # restarted (the call waits for it)
        got = c.receive(1, timeout=30)  # from the TargetList's buffer: room for one more
        assert [m.body for m in got] == [b"held"]
        # Its next fetch finds the channel broken, and goes by Ray to the restarted
        # actor, which delivers offset 1 again (it knows of no delivery before it).
        side = {}
        while not side.get("delivered") and time.monotonic() < deadline:
            side = _call(q._actor.consumer_stats, c.consumer_id)
            time.sleep(0.02)  # polling a condition, with a deadline
        assert side.get("delivered") == 1 and side["death_watch"], side


def test_a_consumer_drops_what_it_loaded_from_a_queue_process_that_died(broker):
    """The restarted queue actor delivers again all that is not acknowledged, while the
    consumer's TargetList still holds copies from the dead process. Once it registers
    with the new process it drops them: the application gets those messages from the
    new process only, not a stale copy too (which it could ack before the fresh one).
    What the client had taken already (its buffer) is received, then again."""
    q = broker.create_queue("stale-copies")
    bodies = [f"m{i}".encode() for i in range(301)]
    q.send_batch(bodies)
    with q.consumer(prefetch=300) as c:
        c.ack(c.receive(1, timeout=30), wait=True)  # the client buffers more of them
        deadline = time.monotonic() + 60
        side: dict = {}
        while side.get("held") != 300 and time.monotonic() < deadline:
            side = _call(q._actor.consumer_stats, c.consumer_id)  # m1-m300 loaded
            time.sleep(0.02)  # polling a condition, with a deadline
        assert side["held"] == 300, side
        before = c.stats()
        loaded, buffered = before["watermark"], before["client_buffered"]
        assert loaded > 0 and loaded + buffered == 300, before
        os.kill(_call(q._actor.pid), signal.SIGKILL)
        assert q.stats()["depth"] == 300  # restarted (the call waits for it)
        # The loader's next poll finds the channel broken; it registers again.
        mine: dict = {}
        while mine.get("stale_dropped") != loaded and time.monotonic() < deadline:
            mine = c.stats()
            time.sleep(0.02)  # polling a condition, with a deadline
        assert mine["stale_dropped"] == loaded, mine
        got = []
        while len(got) < buffered + 300 and time.monotonic() < deadline:
            got += c.receive(buffered + 300 - len(got), timeout=5)
        assert [m.body for m in got] == bodies[1 : 1 + buffered] + bodies[1:]
        c.ack(got, wait=True)
    assert q.stats()["depth"] == 0


def test_message_ids_store_each_message_once_across_a_queue_kill(broker):
    """A producer that resends after the queue process died (its answer lost, say)
    stores nothing twice: the ids are found again by the restarted actor."""
    q = broker.create_queue("once")
    first = q.send(b"a", {"k": 1}, message_id="order-1")
    offsets = q.send_batch([b"b", b"c"], message_ids=["order-2", "order-3"])
    assert q.send(b"a", {"k": 1}, message_id="order-1") == first
    pid = _call(q._actor.pid)
    os.kill(pid, signal.SIGKILL)
    again = broker.get_queue("once")
    assert again.send_batch([b"b", b"c", b"d"], message_ids=["order-2", "order-3", "order-4"]) == [
        *offsets,
        offsets[-1] + 1,
    ]
    table = pa.table({"body": [b"e", b"e"], "n": [1, 2]})
    assert len(set(again.send_batch(table, message_ids=["order-5", "order-5"]))) == 1
    stats = again.stats()
    assert stats["depth"] == 5 and stats["duplicates_dropped"] == 3
    got = [(m.body, m.properties.get("_AMQ_DUPL_ID")) for m in again.browse()]
    assert got == [
        (b"a", "order-1"),
        (b"b", "order-2"),
        (b"c", "order-3"),
        (b"d", "order-4"),
        (b"e", "order-5"),
    ]
    with pytest.raises(InvalidSetting, match="once"):
        again.send_batch([b"x"], message_ids=["a", "b"])


def test_a_nack_delay_holds_and_survives_a_queue_kill(broker):
    q = broker.create_queue("later")
    q.send_batch([b"soon", b"much-later"])
    c = q.consumer(prefetch=10)
    got = c.receive(2, timeout=10.0)
    assert [m.body for m in got] == [b"soon", b"much-later"]
    t0 = time.monotonic()
    assert c.nack(got[0], delay=1.0) == 1
    assert c.nack(got[1], delay=3600.0) == 1
    again = c.receive(1, timeout=30.0)
    assert [m.body for m in again] == [b"soon"] and time.monotonic() - t0 >= 1.0
    c.ack(again)
    assert q.stats()["delayed_messages"] == 1
    os.kill(_call(q._actor.pid), signal.SIGKILL)
    q = broker.get_queue("later")
    stats = q.stats()
    assert stats["delayed_messages"] == 1 and stats["depth"] == 1 and stats["in_flight"] == 0
    with q.consumer(prefetch=10) as fresh:
        assert fresh.receive(1, timeout=0.5) == []


def test_concurrent_sends_of_one_id_over_the_channel_store_it_once(broker):
    import concurrent.futures

    q = broker.create_queue("racing-ids")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: q.send(b"x", message_id=f"id-{i % 3}"), range(24)))
    by_id = {}
    for i, offset in enumerate(got):
        by_id.setdefault(i % 3, set()).add(offset)
    assert all(len(offsets) == 1 for offsets in by_id.values())
    stats = q.stats()
    assert stats["depth"] == 3 and stats["duplicates_dropped"] == 21
