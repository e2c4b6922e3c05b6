"""The consume path with default settings, on a real Ray: pipelined acks (what a crash
before they are sent means), a handle reading its own acks, ``for message in
consumer``, and ``Message`` as delivered."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import ray

from raymq.errors import ConsumerClosed, InvalidAck
from raymq.wire.errors import WireBroken
from tests.consumer_helpers import wait_for


def fill(q, n: int) -> None:
    q.send_batch([f"m{i}".encode() for i in range(n)], {"k": "v"})


@ray.remote(num_cpus=0)
class AckingProcess:
    """A separate worker process that acks with the default (pipelined) ack, whose acks
    never leave it: nothing sends them before it is killed."""

    def __init__(self, namespace: str, queue: str):
        import raymq
        import raymq.client.acks

        raymq.client.acks.ACK_LINGER_SECONDS = 3600.0  # no linger send before the kill
        self.c = raymq.connect(namespace=namespace).get_queue(queue).consumer()
        assert self.c._acks.linger_seconds == 3600.0

    def receive_and_ack(self, n: int) -> list[int]:
        got = []
        while len(got) < n:
            msgs = self.c.receive(n - len(got), timeout=30)
            self.c.ack(msgs)  # pipelined: returns at once
            got += [m.offset for m in msgs]
        assert self.c._acks.unsent == n  # gathered, not sent
        return got

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class ConsumingProcess:
    """A worker process that only consumes: it has no send connection to the queue
    until its first pipelined ack opens one in the background."""

    def __init__(self, namespace: str, queue: str):
        import raymq

        self.q = raymq.connect(namespace=namespace).get_queue(queue)
        self.c = self.q.consumer()

    def ack_one_by_one(self, n: int) -> tuple[int, int]:
        """Receive and ack ``n`` messages, each alone; returns (ack calls that went as
        frames on the send connection, ack calls sent in all)."""
        import time

        got, calls = 0, 0
        channel_deadline = None
        while got < n:
            msgs = self.c.receive(1, timeout=30)
            assert msgs, f"only {got} of {n} came"
            self.c.ack(msgs[0])
            self.c.flush()  # one call each, answered
            calls += 1
            got += 1
            if channel_deadline is None:
                channel_deadline = time.monotonic() + 30
                while self.q._ack_channel() is None:  # opening in the background
                    assert time.monotonic() < channel_deadline, "no send connection in 30 s"
                    time.sleep(0.01)
        return self.c.acks_over_wire, calls

    def close(self) -> None:
        self.c.close()


def test_a_consumer_only_process_acks_over_the_send_connection_once_open(broker):
    q = broker.create_queue("wire-acks")
    fill(q, 30)
    worker = ConsumingProcess.remote(broker.namespace, "wire-acks")
    over_wire, calls = ray.get(worker.ack_one_by_one.remote(30))
    assert calls == 30
    assert over_wire == 29  # the first went by Ray while the connection opened
    ray.get(worker.close.remote())
    assert q.stats()["depth"] == 0  # every ack applied, on either path


def test_a_crash_between_a_pipelined_ack_and_its_flush_redelivers(broker):
    q = broker.create_queue("crash-acks")
    fill(q, 20)
    worker = AckingProcess.remote(broker.namespace, "crash-acks")
    acked = ray.get(worker.receive_and_ack.remote(20))
    assert sorted(acked) == list(range(20))
    os.kill(ray.get(worker.pid.remote()), signal.SIGKILL)
    with q.consumer() as c:
        got = {}
        while len(got) < 20:
            msgs = c.receive(20, timeout=30)
            assert msgs, f"only {len(got)} of 20 came back"
            got.update((m.offset, m.delivery_count) for m in msgs)
        c.ack(list(got), wait=True)
    assert got == {o: 2 for o in range(20)}  # each delivered again, none lost
    assert q.stats()["depth"] == 0


def test_default_acks_are_pipelined_and_the_handle_reads_its_own(broker):
    q = broker.create_queue("own-acks")
    fill(q, 50)
    with q.consumer() as c:
        msgs = c.receive(max_messages=50, timeout=30)
        assert len(msgs) == 50
        assert c.ack(msgs[:30]) is None  # pipelined
        assert q.stats()["depth"] == 20  # stats() sent and waited for them first
        assert c.ack(msgs[30:], wait=True) == 20  # durable, counted
    assert q.stats()["depth"] == 0


def test_iterating_a_consumer_yields_every_message_in_order(broker):
    q = broker.create_queue("iterate")
    fill(q, 300)
    with q.consumer() as c:
        seen = []
        for message in c:
            assert message.body == f"m{message.offset}".encode()
            assert message.properties == {"k": "v"} and message.delivery_count == 1
            c.ack(message)
            seen.append(message.offset)
            if len(seen) == 100:
                break  # leaves the loop mid-chunk: the rest stay this consumer's
        rest = c.receive(max_messages=300, timeout=30)
        assert [m.offset for m in rest][:1] == [100]  # the next one, not skipped
        while len(rest) < 200:
            more = c.receive(max_messages=300, timeout=30)
            assert more, f"only {len(rest)} of the other 200 came"
            rest += more
        assert [m.offset for m in rest] == list(range(100, 300))
        assert all(m.delivery_count == 1 for m in rest)  # handed back, not redelivered
        c.ack(rest)
        c.flush()
    assert seen == list(range(100))
    assert q.stats()["depth"] == 0


def test_iteration_ends_when_the_consumer_closes(broker):
    q = broker.create_queue("iterate-close")
    fill(q, 3)
    c = q.consumer()
    seen = []
    for message in c:
        seen.append(message.offset)
        c.ack(message)
        if len(seen) == 3:
            c.close()  # flushes the acks; the loop then ends
    assert seen == [0, 1, 2]
    assert q.stats()["depth"] == 0


def test_one_refused_offset_in_a_pipelined_call_does_not_lose_the_others(broker):
    q = broker.create_queue("refused-ack")
    fill(q, 40)
    with q.consumer() as c:
        msgs = c.receive(max_messages=40, timeout=30)
        while len(msgs) < 40:
            more = c.receive(max_messages=40, timeout=30)
            assert more, f"only {len(msgs)} of 40 came"
            msgs += more
        for m in msgs[:10]:
            c.ack(m)  # per message: one gathered call with the bad offset below
        c.ack(10**9)  # never sent: the queue refuses the whole call for it
        c.ack(msgs[10:20])
        stats = q.stats()  # sends and waits, raising nothing of the consumer's
        assert stats["depth"] == 20  # the 20 good acks were applied
        with pytest.raises(InvalidAck, match=str(10**9)):
            c.flush()  # the error stayed for the consumer
        with pytest.raises(InvalidAck, match=str(10**9)):
            c.ack([*msgs[20:30], 10**9], wait=True)  # waiting: refused, it changes nothing
        assert q.stats()["depth"] == 20
        c.ack(msgs[20:])
        c.flush()
    assert q.stats()["depth"] == 0


def test_close_from_another_thread_ends_iteration_and_a_waiting_receive(broker):
    q = broker.create_queue("close-from-thread")
    fill(q, 5)
    c = q.consumer()
    seen, errors = [], []

    def iterate() -> None:
        for message in c:  # then waits for more, which never come
            c.ack(message)  # before it is counted: the main thread closes at 5 counted
            seen.append(message.offset)

    def receive() -> None:
        try:
            c.receive(timeout=None)
        except ConsumerClosed as exc:
            errors.append(exc)

    threads = [threading.Thread(target=iterate), threading.Thread(target=receive)]
    threads[0].start()
    while len(seen) < 5:  # the iteration got all: both now wait on an empty queue
        threads[0].join(timeout=0.01)
        assert threads[0].is_alive()
    threads[1].start()
    c.close()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a receive went on after close"
    assert sorted(seen) == list(range(5)) and len(errors) == 1
    assert q.stats()["depth"] == 0


def test_rows_of_an_answer_lost_mid_read_on_the_delivery_channel_come_back(broker):
    q = broker.create_queue("unread-answer")
    with q.consumer() as c:
        assert c._channel is not None
        client = c._channel._client
        real = client.call

        def cut_mid_answer(op, args, buffers=(), **kw):
            answer = real(op, args, buffers, **kw)
            if op == "take" and answer.value == "ipc":  # written by the TargetList, unread
                client.close()
                broken = WireBroken("cut mid-answer")
                broken.answer_pending = True
                raise broken
            return answer

        client.call = cut_mid_answer
        fill(q, 5)
        got = {}
        while len(got) < 5:
            msgs = c.receive(max_messages=5, timeout=30)  # through Ray after the break
            assert msgs, f"only {sorted(got)} of 5 came back"
            got.update((m.offset, m.delivery_count) for m in msgs)
        assert c._channel is None and c.delivery_channel_failures == 1
        assert c.delivery_channel_unread == 0
        assert got == {o: 1 for o in range(5)}  # given back unread: not counted
        assert c.stats()["delivery_channel_given_back"] >= 1
        c.ack(list(got), wait=True)
    assert q.stats()["depth"] == 0


def _frozen(_actor) -> int:
    import gc

    return gc.get_freeze_count()


def test_the_queue_and_target_list_processes_keep_their_start_up_heaps_out_of_full_gcs(
    broker,
):
    """A full collection of a start-up heap pauses the process 50-75 ms (raymq.heap):
    the queue's actor and a consumer's TargetList freeze theirs once started."""
    q = broker.create_queue("frozen-heaps", durable=True)
    q.send(b"one")
    c = q.consumer()
    assert [m.body for m in c.receive(timeout=30)] == [b"one"]
    # Ray, pyarrow and numpy alone leave well over 50,000 objects after the imports.
    assert ray.get(q._actor.__ray_call__.remote(_frozen)) > 50_000
    assert ray.get(c.target_list.__ray_call__.remote(_frozen)) > 50_000
    c.close()


def test_a_follower_process_freezes_its_start_up_heap_though_nobody_calls_it(ray_session, tmp_path):
    """A follower's process freezes its start-up heap when it starts, not when the
    controller's ``ready()`` reaches it: Ray restarts a killed follower in a new process,
    whose ``ready()`` nobody calls (the controller's went to the one that died)."""
    from raymq.actors.replica_actor import ReplicaActor

    actor = ReplicaActor.remote("frozen-follower", "r1", str(tmp_path / "r1"), 1, "raymq-frozen")
    try:
        first = ray.get(actor.pid.remote())
        assert ray.get(actor.__ray_call__.remote(_frozen)) > 50_000
        os.kill(first, signal.SIGKILL)

        def restarted() -> bool:
            try:
                return ray.get(actor.pid.remote(), timeout=30) != first
            except ray.exceptions.RayActorError:  # (the call reached the dying process)
                return False

        wait_for(restarted, "the follower's process restarted")
        assert ray.get(actor.__ray_call__.remote(_frozen)) > 50_000
    finally:
        ray.kill(actor)


def _slow_channel_start(actor) -> None:
    """Make the follower's channel take 0.5 s to start: calls made meanwhile overlap it."""
    import asyncio

    start = actor._channel.start

    async def slow(host: str):
        await asyncio.sleep(0.5)
        return await start(host)

    actor._channel.start = slow


def test_a_followers_channel_answers_every_caller_that_asks_while_it_starts(ray_session, tmp_path):
    """The controller's ``ready()`` and the leader's first write reach a new follower
    together: whichever asks while the channel starts gets its endpoint too, not None
    (which would keep the leader on Ray calls for good)."""
    from raymq.actors.replica_actor import ReplicaActor

    actor = ReplicaActor.remote("two-askers", "r1", str(tmp_path / "r1"), 1, "raymq-askers")
    try:
        ray.get(actor.__ray_call__.remote(_slow_channel_start))
        first, second = ray.get([actor.endpoint.remote(), actor.endpoint.remote()])
        assert first is not None and second == first
    finally:
        ray.kill(actor)


def _failing_channel_start(actor) -> None:
    """Make the follower's channel start fail with an error that is not an OSError."""

    async def fail(host: str):
        raise RuntimeError("no channel today")

    actor._channel.start = fail


def test_a_followers_channel_that_fails_to_start_answers_none_to_every_caller(
    ray_session, tmp_path
):
    """Its start is shared by every caller: a failure is a None (the leader then writes
    through Ray calls), never an error stored for each later caller to raise."""
    from raymq.actors.replica_actor import ReplicaActor

    actor = ReplicaActor.remote("no-channel", "r1", str(tmp_path / "r1"), 1, "raymq-no-channel")
    try:
        ray.get(actor.__ray_call__.remote(_failing_channel_start))
        assert ray.get([actor.endpoint.remote(), actor.endpoint.remote()]) == [None, None]
        assert ray.get(actor.endpoint.remote()) is None and ray.get(actor.ping.remote()) == 1
    finally:
        ray.kill(actor)
