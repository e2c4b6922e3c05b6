"""The send protocol (``raymq.wire.send``) without Ray: a real socket between a
SendChannel and a SendServer whose event loop runs in a thread; the server stores into a
list instead of a QueueCore."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import sys
import threading
import time
from concurrent.futures import Future

import msgpack
import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.errors import AddressFull, InvalidAck, InvalidSetting
from raymq.wire import frames
from raymq.wire.errors import WireBroken
from raymq.wire.send import SendChannel, SendServer
from tests.wire_helpers import (
    MutePeer,
    hello,
    raw_client,
    read_answers,
    read_frame,
    request,
)

MAX_MESSAGE = 1024


class Store:
    """A queue stand-in: offsets in order, one list entry per stored batch; a body of
    b"full" is refused with AddressFull, b"drop" is dropped."""

    def __init__(self):
        self.bodies: list[bytes] = []
        self.properties: list[bytes] = []  # msgpack, as stored
        self.batches: list[int] = []
        self.acked: list[tuple[str, str | None, int]] = []  # (consumer, subscription, offset)
        self.settled: list[tuple] = []  # nacks and rejects, as received
        self.release = asyncio.Event()
        self.hold = False
        self.started = threading.Event()  # a store call began
        self._tickets = 0  # calls begun
        self._served = 0  # calls stored (or refused)

    async def send_batch(self, batch: MessageBatch, timeout: float | None) -> tuple[int, int]:
        ticket = self._tickets
        self._tickets += 1
        self.started.set()
        if self.hold:
            await self.release.wait()
        while self._served != ticket:  # stored in the order the calls began, as by a queue
            await asyncio.sleep(0)
        try:
            bodies = [batch.body(i) for i in range(len(batch))]
            if b"full" in bodies:
                raise AddressFull(f"queue 'q' is full (timeout {timeout})")
            kept = [b for b in bodies if b != b"drop"]
            first = len(self.bodies)
            self.bodies.extend(kept)
            self.properties.extend(
                batch.properties_bytes(i) for i, b in enumerate(bodies) if b != b"drop"
            )
            self.batches.append(len(bodies))
        finally:
            self._served += 1
        await asyncio.sleep(0.001)  # a group commit takes a while: others gather meanwhile
        return first, len(kept)

    async def ack(self, consumer_id: str, offsets: np.ndarray, subscription: str | None) -> int:
        """Acks as a queue takes them: a negative offset is refused (never delivered)."""
        if (offsets < 0).any():
            raise InvalidAck(f"queue 'q': consumer {consumer_id} never held {offsets.min()}")
        new = [int(o) for o in offsets if (consumer_id, subscription, int(o)) not in self.acked]
        self.acked.extend((consumer_id, subscription, o) for o in new)
        await asyncio.sleep(0.001)  # durable a commit later
        return len(new)

    async def nack(self, consumer_id, offsets, subscription, delay) -> int:
        """Nacks as a queue takes them: a delay out of range refused by the queue."""
        if delay is not None and not 0 <= delay <= 10:
            raise InvalidSetting(f"delay={delay!r} for queue 'q' must be seconds from 0 to 10")
        self.settled.append(("nack", consumer_id, subscription, offsets.tolist(), delay))
        return len(offsets)

    async def reject(self, consumer_id, offsets, subscription) -> int:
        if (offsets < 0).any():
            raise InvalidAck(f"queue 'q': consumer {consumer_id} never held {offsets.min()}")
        self.settled.append(("reject", consumer_id, subscription, offsets.tolist()))
        return len(offsets)


@pytest.fixture
def served():
    """(store, server, (host, port, secret), loop) with the loop running in a thread."""
    yield from _serve(gather=True)


@pytest.fixture
def served_apart():
    """``served`` with a server that stores each single send alone (``gather=False``)."""
    yield from _serve(gather=False)


def _serve(gather: bool):
    store = Store()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    out = {}

    def run():
        asyncio.set_event_loop(loop)
        server = SendServer(
            store.send_batch,
            "q",
            MAX_MESSAGE,
            gather=gather,
            ack=store.ack,
            nack=store.nack,
            reject=store.reject,
        )
        out["server"] = server
        out["endpoint"] = loop.run_until_complete(server.start("127.0.0.1"))
        ready.set()
        loop.run_forever()
        pending = asyncio.all_tasks(loop)  # connections still served: end them cleanly
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    yield store, out["server"], out["endpoint"], loop
    loop.call_soon_threadsafe(out["server"].close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def in_threads(produce, n: int) -> None:
    """Run ``produce(k)`` for k in range(n), each in its own thread; wait for all."""
    threads = [threading.Thread(target=produce, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_sends_from_many_threads_come_back_with_their_offsets(served):
    store, _, (host, port, secret), _ = served
    channel = SendChannel(host, port, secret, "q")
    got: dict[bytes, int] = {}
    lock = threading.Lock()

    def produce(k: int) -> None:
        for i in range(50):
            body = f"{k}-{i}".encode()
            offset = channel.send(body, b"", None)
            with lock:
                got[body] = offset

    in_threads(produce, 8)
    channel.close()
    assert sorted(got.values()) == list(range(400))
    assert all(store.bodies[offset] == body for body, offset in got.items())
    assert len(store.batches) < 400  # requests arriving together share a batch


def test_a_server_that_does_not_gather_stores_each_send_alone(served_apart):
    """A queue that judges batches whole (FAIL, BLOCK) judges, and stores, each
    client's send alone, even when many arrive in one read."""
    store, _, (host, port, secret), _ = served_apart
    sock = raw_client(host, port, secret)
    sock.sendall(b"".join(request(k, "send", [f"m{k}".encode(), b"", None]) for k in range(50)))
    answers = read_answers(sock, 50)
    assert answers == {k: (None, k) for k in range(50)}
    assert store.bodies == [f"m{k}".encode() for k in range(50)]
    assert store.batches == [1] * 50
    sock.close()


def test_errors_come_back_typed_and_drops_as_none(served):
    _, _, (host, port, secret), _ = served
    channel = SendChannel(host, port, secret, "q")
    with pytest.raises(AddressFull, match="full"):
        channel.send(b"full", b"", 0.5)
    assert channel.send(b"drop", b"", None) is None
    assert channel.send(b"kept", b"", None) == 0
    channel.close()


def test_acks_are_answered_with_how_many_were_new_and_refusals_come_back_typed(served):
    store, _, (host, port, secret), _ = served
    channel = SendChannel(host, port, secret, "q")
    futures = [Future() for _ in range(4)]
    channel.submit_ack("c1", np.array([3, 1, 2]), None, futures[0])
    channel.submit_ack("c1", np.array([2, 4], dtype=np.int64), None, futures[1])  # 2 again
    channel.submit_ack("c2", np.array([1]), "sub", futures[2])
    channel.submit_ack("c1", np.array([5, -1]), None, futures[3])
    assert [f.result(timeout=10) for f in futures[:3]] == [3, 1, 1]
    with pytest.raises(InvalidAck, match="never held -1"):
        futures[3].result(timeout=10)
    assert sorted(store.acked) == sorted(
        [("c1", None, o) for o in (1, 2, 3, 4)] + [("c2", "sub", 1)]
    )
    channel.close()


def test_a_consumers_waited_ack_nack_and_reject_are_answered_on_the_channel(served):
    """``consumer_call`` waits for each answer; the queue's refusals come back typed and
    the connection goes on; offsets, subscription and delay arrive as sent."""
    store, _, (host, port, secret), _ = served
    channel = SendChannel(host, port, secret, "q")
    assert channel.consumer_call("ack", "c1", np.array([7, 8]), None) == 2
    assert channel.consumer_call("ack", "c1", np.array([8]), None) == 0  # again: none new
    assert channel.consumer_call("nack", "c1", np.array([3, 1]), "sub", 2.5) == 2
    assert channel.consumer_call("nack", "c1", np.array([4]), None, None) == 1
    with pytest.raises(InvalidSetting, match="delay=99"):
        channel.consumer_call("nack", "c1", np.array([5]), None, 99)
    assert channel.consumer_call("reject", "c2", np.array([6]), "sub") == 1
    with pytest.raises(InvalidAck, match="never held -2"):
        channel.consumer_call("reject", "c2", np.array([-2, 6]), None)
    assert store.settled == [
        ("nack", "c1", "sub", [3, 1], 2.5),
        ("nack", "c1", None, [4], None),
        ("reject", "c2", "sub", [6]),
    ]
    assert sorted(store.acked) == [("c1", None, 7), ("c1", None, 8)]
    assert channel.broken is None
    channel.close()


def test_a_malformed_ack_fails_alone(served):
    store, _, (host, port, secret), _ = served
    sock = raw_client(host, port, secret)
    good = np.array([7], dtype="<i8").tobytes()
    sock.sendall(
        request(1, "ack", ["c", None], [good[:7]])  # not a whole int64
        + request(2, "ack", [b"c", None], [good])  # consumer id as bytes
        + request(3, "ack", ["c"], [good])  # no subscription
        + request(4, "ack", ["c", None], [good])
    )
    answers = read_answers(sock, 4)
    assert answers[1][0] == answers[3][0] == "ValueError"
    assert answers[2][0] == "TypeError"
    assert answers[4] == (None, 1)
    assert store.acked == [("c", None, 7)]
    sock.close()


def test_a_wrong_secret_gets_no_channel(served):
    store, _, (host, port, _secret), _ = served
    with pytest.raises(WireBroken):
        SendChannel(host, port, "not the secret", "q")
    assert store.bodies == []


def test_an_oversize_frame_ends_the_connection_and_stores_nothing(served):
    store, _, (host, port, secret), _ = served
    channel = SendChannel(host, port, secret, "q")
    with pytest.raises(WireBroken):
        channel.send(b"x" * (MAX_MESSAGE + 100_000), b"", None)
    with pytest.raises(WireBroken):  # broken stays broken
        channel.send(b"small", b"", None)
    assert store.bodies == []


def test_sends_waiting_when_the_server_goes_away_raise_channel_broken(served):
    store, server, (host, port, secret), loop = served
    store.hold = True  # the "queue" does not answer yet
    channel = SendChannel(host, port, secret, "q")
    errors: list[BaseException] = []

    def send() -> None:
        try:
            channel.send(b"waiting", b"", None)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    assert store.started.wait(10)  # the send waits in the store
    # The server's side of the connection goes away under the waiting send.
    cut = asyncio.run_coroutine_threadsafe(_abort_connections(server), loop)
    assert cut.result(10) == 1
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], WireBroken)
    assert errors[0].answer_pending  # written: the queue may have stored it
    with pytest.raises(WireBroken):  # broken stays broken
        channel.send(b"after", b"", None)
    loop.call_soon_threadsafe(store.release.set)


async def _abort_connections(server: SendServer) -> int:
    conns = list(server.server._open)
    for conn in conns:
        conn.transport.abort()
    return len(conns)


def test_frames_are_a_length_then_a_msgpack_header_then_raw_buffers():
    assert frames.header_bytes([True]) == b"\x00\x00\x00\x02\x91\xc3"
    body = bytearray(b"raw")
    head, raw = frames.encode([7, "send_batch", [None]], [body])
    assert bytes(head) == b"\x00\x00\x00\x11" + msgpack.packb([7, "send_batch", [None], [3]])
    assert raw.obj is body  # a raw buffer is not copied


def test_batches_and_single_sends_share_a_channel_from_many_threads(served):
    store, _, (host, port, secret), _ = served
    channel = SendChannel(host, port, secret, "q")
    got: dict[bytes, int] = {}
    lock = threading.Lock()

    def produce(k: int) -> None:
        for i in range(20):
            bodies = [f"{k}-{i}-{j}".encode() for j in range(5)]
            batch = MessageBatch.from_bodies(bodies, {"k": k}, max_message_size=MAX_MESSAGE)
            first, count = channel.send_batch(batch, None)
            single = f"{k}-{i}-single".encode()
            offset = channel.send(single, b"", None)
            with lock:
                got.update({b: first + j for j, b in enumerate(bodies[:count])})
                got[single] = offset

    in_threads(produce, 6)
    channel.close()
    assert sorted(got.values()) == list(range(6 * 20 * 6))
    assert all(store.bodies[offset] == body for body, offset in got.items())


def test_a_batch_keeps_its_properties_and_its_errors_typed(served):
    store, _, (host, port, secret), _ = served
    channel = SendChannel(host, port, secret, "q")
    props = [{"color": "red", "n": 1}, None, {"ok": True}]
    batch = MessageBatch.from_bodies([b"a", b"drop", b"c"], props, max_message_size=MAX_MESSAGE)
    assert channel.send_batch(batch, None) == (0, 2)  # the store drops b"drop"
    with pytest.raises(AddressFull, match="full"):
        full = MessageBatch.from_bodies([b"b", b"full"], max_message_size=MAX_MESSAGE)
        channel.send_batch(full, 0.5)
    assert store.bodies == [b"a", b"c"]
    assert [msgpack.unpackb(p) if p else None for p in store.properties] == [props[0], props[2]]
    channel.close()


def test_a_batch_whose_offsets_do_not_fit_its_data_is_refused(served):
    store, _, (host, port, secret), _ = served
    channel = SendChannel(host, port, secret, "q")
    batch = MessageBatch.from_bodies([b"abc", b"def"], max_message_size=MAX_MESSAGE)
    batch.body_offsets = batch.body_offsets.copy()
    batch.body_offsets[-1] = 99  # past the end of the body bytes
    with pytest.raises(ValueError, match="offsets do not fit"):
        channel.send_batch(batch, None)
    assert channel.send(b"still open", b"", None) == 0
    assert store.bodies == [b"still open"]
    channel.close()


def test_a_malformed_request_fails_alone_and_the_good_one_in_its_gather_is_stored(served):
    store, _, (host, port, secret), _ = served
    sock = raw_client(host, port, secret)
    bad_props = b"\xc1"  # never valid msgpack
    sock.sendall(  # one write: the server gathers them together
        request(1, "send", [b"good", b"", None])
        + request(2, "send", [b"bad", b"", [1]])  # an unhashable timeout
        + request(3, "send", [b"bad", bad_props, None])
        + request(4, "send", [b"bad", msgpack.packb({"k": [1, 2]}), None])  # a list: no property
        + request(5, "send", [b"bad", b"", -1.0])
    )
    answers = read_answers(sock, 5)
    assert answers[1] == (None, 0)
    assert answers[2][0] == answers[5][0] == "TypeError"
    assert answers[3][0] == answers[4][0] == "InvalidProperties"
    assert store.bodies == [b"good"]
    sock.sendall(request(6, "ping", []))  # the connection is still served
    assert read_frame(sock) == ([6, None, True, []], [])
    sock.close()


def test_an_oversized_message_fails_alone_in_its_gather(served):
    """A forged frame within the frame limit but over max_message_size (body plus
    properties) gets its own MessageTooLarge; its neighbours are stored."""
    store, _, (host, port, secret), _ = served
    sock = raw_client(host, port, secret)
    sock.sendall(
        request(1, "send", [b"a", b"", None])
        + request(2, "send", [b"x" * (MAX_MESSAGE + 1), b"", None])
        + request(3, "send", [b"x" * (MAX_MESSAGE - 4), msgpack.packb({"k": "too much"}), None])
        + request(4, "send", [b"b", b"", None])
    )
    answers = read_answers(sock, 4)
    assert answers[2][0] == answers[3][0] == "MessageTooLarge"
    assert answers[1][0] is None and answers[4][0] is None
    assert store.bodies == [b"a", b"b"]
    sock.close()


def test_a_silent_connection_is_closed_and_connections_are_capped(served, monkeypatch):
    from raymq.wire import server as wire_server

    _, server, (host, port, secret), _ = served
    monkeypatch.setattr(wire_server, "HELLO_TIMEOUT_SECONDS", 0.2)
    silent = raw_client(host, port, None)  # never sends the secret
    assert silent.recv(1) == b""  # closed by the server, not by us
    silent.close()
    wire = server.server
    monkeypatch.setattr(wire, "protocol", dataclasses.replace(wire.protocol, max_connections=2))
    monkeypatch.setattr(wire_server, "HELLO_TIMEOUT_SECONDS", 60)
    kept = [raw_client(host, port, secret) for _ in range(2)]
    extra = socket.create_connection((host, port), timeout=30)
    assert extra.recv(1) == b""  # over the cap: closed at once
    assert wire.refused_connections == 1
    extra.close()
    for sock in kept:
        sock.close()


def test_a_client_waiting_on_a_dead_server_gets_wire_broken(monkeypatch):
    from raymq.wire import send

    monkeypatch.setattr(send, "REPLY_PATIENCE_SECONDS", 0.3)
    # A peer that authenticates clients and then answers nothing, not even pings.
    peer = MutePeer()
    channel = SendChannel(*peer.endpoint(), "q")
    with pytest.raises(WireBroken, match="ping"):
        channel.send(b"lost?", b"", None)
    channel.close()
    peer.close()


def test_a_write_to_a_peer_that_reads_nothing_breaks_the_channel_in_bounded_time(monkeypatch):
    """A paused queue actor takes no bytes: a send whose bytes cannot all be written
    must not wait for ever. The broken channel's connection is closed for real (its
    unsent bytes dropped), not left waiting for the peer to read them."""
    from raymq.wire import send

    monkeypatch.setattr(send, "REPLY_PATIENCE_SECONDS", 0.3)
    peer = MutePeer()
    channel = SendChannel(*peer.endpoint(), "q")
    # More than any socket buffer holds: the write must wait for the peer.
    batch = MessageBatch.from_bodies([b"x" * 2**20] * 64, max_message_size=2**21)
    started = time.monotonic()
    with pytest.raises(WireBroken):
        channel.send_batch(batch, None)
    assert time.monotonic() - started < 20
    client = channel._client._client
    closed = asyncio.run_coroutine_threadsafe(client.wait_closed(), channel._client._loop)
    closed.result(10)  # the transport is gone, unsent bytes and all
    with pytest.raises(WireBroken):  # broken for good: the sender goes by Ray
        channel.send(b"after", b"", None)
    peer.close()


def test_an_answer_for_a_send_whose_event_loop_ended_leaves_the_channel_working(served):
    """A timed-out ``send_async`` in an ``asyncio.run`` that has returned: its answer
    comes later, to a closed loop. The channel and the sends after it go on."""
    store, _, (host, port, secret), loop = served
    store.hold = True
    channel = SendChannel(host, port, secret, "q")

    async def impatient() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(channel.send_async(b"late", b"", None), 0.05)

    asyncio.run(impatient())
    asyncio.run(impatient())  # two stale replies: neither may stop the others
    later: Future = Future()
    channel.submit_one(b"next", b"", None, later)
    loop.call_soon_threadsafe(store.release.set)
    assert later.result(timeout=30) == 2
    assert channel.broken is None
    assert channel.send(b"and on", b"", None) == 3
    channel.close()


def test_a_blocked_send_outlives_the_reply_patience_while_the_server_answers_pings(
    served, monkeypatch
):
    from raymq.wire import send

    store, server, (host, port, secret), loop = served
    monkeypatch.setattr(send, "REPLY_PATIENCE_SECONDS", 0.1)
    store.hold = True
    channel = SendChannel(host, port, secret, "q")
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(channel.send(b"late", b"", None)))
    t.start()
    idle = threading.Event()
    while server.server.pings_answered < 3:  # the send waits on while its pings are answered
        idle.wait(0.01)
    loop.call_soon_threadsafe(store.release.set)
    t.join(30)
    assert result == [0] and channel.broken is None
    channel.close()


def test_frames_split_anywhere_or_run_together_are_each_answered(served):
    """The server parses frames from whatever bytes each read brings: one byte at a
    time (the hello, a send, a batch header and its buffers cut mid-way), or several
    requests in one write."""
    store, _, (host, port, secret), _ = served
    sock = socket.create_connection((host, port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    batch = MessageBatch.from_bodies([b"b1", b"b2"], max_message_size=MAX_MESSAGE)
    buffers = [memoryview(b).cast("B").tobytes() for b in batch.wire_buffers()]
    stream = (
        hello(secret, "send")
        + request(1, "send", [b"one", b"", None])
        + request(2, "send_batch", [None], buffers)
        + request(3, "ping", [])
    )
    for i in range(len(stream)):  # a byte a write: TCP_NODELAY sends each at once
        sock.sendall(stream[i : i + 1])
    assert read_frame(sock)[0][:2] == [0, None]  # the hello's answer
    answers = read_answers(sock, 3)
    sock.sendall(
        request(4, "send", [b"two", b"", None])
        + request(5, "send", [b"three", b"", 1.5])
        + request(6, "ping", [])
    )
    answers.update(read_answers(sock, 3))
    # A single send and a batch are stored in whichever order their commits take.
    (_, one), (_, (first, count)) = answers[1], answers[2]
    assert count == 2 and {one, first, first + 1} == {0, 1, 2}
    assert store.bodies[one] == b"one" and store.bodies[first : first + 2] == [b"b1", b"b2"]
    assert answers[3] == (None, True)
    assert {answers[4][1], answers[5][1]} == {3, 4}  # the two timeouts: two gathers
    assert all(error is None for error, _ in answers.values())
    assert sorted(store.bodies) == sorted([b"one", b"b1", b"b2", b"two", b"three"])
    sock.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets")
def test_a_client_on_the_same_machine_connects_over_the_unix_socket_else_tcp(served, monkeypatch):
    from raymq.wire import client, server

    store, _, (host, port, secret), _ = served
    near = SendChannel(host, port, secret, "q")
    assert family(near) == socket.AF_UNIX
    assert secret not in server.unix_address("send", secret)  # local users see the names
    monkeypatch.setattr(client, "unix_address", lambda protocol, secret: None)  # as elsewhere
    far = SendChannel(host, port, secret, "q")
    assert family(far) == socket.AF_INET
    assert (near.send(b"a", b"", None), far.send(b"b", b"", None)) == (0, 1)
    assert store.bodies == [b"a", b"b"]
    near.close()
    far.close()


def family(channel: SendChannel) -> int:
    """The address family of ``channel``'s connection."""
    return channel._client._client._sock.family


def test_stored_sends_are_written_when_stored_not_a_turn_of_the_loop_later():
    """A stored send's answer is written as soon as the store returns, not when its
    task's end is seen a turn of the event loop later: its sender waits on it. Single
    sends stored together flush each connection once; a batch's answer leaves with the
    other answers of its turn (a pipelining producer has several batches in a commit)."""
    from raymq.wire.server import DEFERRED, Request

    events: list[str] = []

    class Conn:
        closing = False

        def write(self, parts) -> bool:
            events.append("write")
            return True

        def flush(self) -> None:
            events.append("flush")

    async def send_batch(batch: MessageBatch, timeout) -> tuple[int, int]:
        return 10, len(batch)

    async def main() -> None:
        server = SendServer(send_batch, "q", 2**20)
        conn = Conn()
        singles = [Request(conn, i, "send", [b"m", b"", None], []) for i in range(3)]
        await server._store([(b"m", b"", None, r) for r in singles])
        assert events == ["write"] * 3 + ["flush"]
        events.clear()
        bodies = MessageBatch.from_bodies(
            [b"a", b"b"], [None, None], max_message_size=2**20, queue="q"
        )
        wire = [bytes(memoryview(b)) for b in bodies.wire_buffers()]
        batch = Request(conn, 9, "send_batch", [None], wire)
        assert await server._batch(batch) is DEFERRED
        # Answered by the store itself; flushed with this turn's other answers.
        assert events == ["write"] and batch.answered

    asyncio.run(main())
