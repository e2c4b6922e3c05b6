"""``SyncClient`` (the wire's client read by its calling thread) against the wire's real
servers and raw peers of ``tests/test_wire.py``: every op answered, typed errors, a
silent server pinged, a request's bound, a busy server waited for past its patience, a
server killed mid-request, nonsense answers, and ``close`` from another thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from raymq.wire import frames
from raymq.wire.errors import WireBroken
from raymq.wire.sync_client import SyncClient
from tests.test_wire import HELD, PROTOCOLS, SPECS, WAIT_SECONDS, run, serving, until
from tests.wire_helpers import READ_SECONDS, MutePeer, exactly


def connect(endpoint, name: str, patience: float = 30.0) -> SyncClient:
    return SyncClient(endpoint, name, "test", patience=patience)


async def held_call(s, name: str, patience: float = 30.0) -> tuple[SyncClient, asyncio.Future]:
    """A client of the server ``s`` and its call of the protocol's held op, under way in
    a thread, held in the back end (``s.backend.gate`` lets it go)."""
    s.backend.hold()
    client = await asyncio.to_thread(connect, s.endpoint, name, patience)
    op, args, buffers = s.spec.held
    waiting = asyncio.ensure_future(asyncio.to_thread(client.call, op, args, buffers))
    await s.backend.entered.wait()
    return client, waiting


@pytest.mark.parametrize("name", PROTOCOLS)
def test_every_op_is_answered_and_typed_errors_leave_the_connection_usable(name):
    async def main():
        async with serving(name) as s:
            client = await asyncio.to_thread(connect, s.endpoint, name)
            for op, args, buffers, ok in s.spec.ops:
                answer = await asyncio.to_thread(client.call, op, args, buffers)
                assert ok(answer), (op, args, answer)
            with pytest.raises((ValueError, TypeError)):  # a malformed request: its own error
                await asyncio.to_thread(client.call, s.spec.ops[0][0], ["not", "its", "args"])
            assert (await asyncio.to_thread(client.call, "ping", [])).value is True
            assert client.broken is None
            client.close()
            with pytest.raises(WireBroken) as after:
                client.call("ping", [])
            assert not getattr(after.value, "answer_pending", False)  # never written

    run(main())


def test_a_wrong_secret_is_refused_as_wire_broken():
    async def main():
        async with serving("delivery", dropping=True) as s:  # (it drops the stranger)
            host, port, _secret = s.endpoint
            with pytest.raises(WireBroken, match="no delivery connection"):
                await asyncio.to_thread(connect, (host, port, "x" * 32), "delivery")

    run(main())


def test_a_silent_server_is_pinged_and_the_client_breaks_within_twice_its_patience():
    patience = 0.3
    peer = MutePeer()  # answers the hello, then reads and answers nothing
    try:
        client = connect(peer.endpoint(), "delivery", patience=patience)
        op, args, buffers, _ = SPECS["delivery"].ops[0]
        started = time.monotonic()
        with pytest.raises(WireBroken, match="ping") as broken:
            client.call(op, args, buffers)
        took = time.monotonic() - started
        assert broken.value.answer_pending
        with pytest.raises(WireBroken):
            client.call(op, args, buffers)  # broken stays broken
    finally:
        peer.close()
    assert 2 * patience * 0.9 <= took < 2 * patience + 10.0  # bounded (a loaded machine stalls)


def test_a_request_with_a_bound_breaks_the_connection_after_it():
    peer = MutePeer()
    try:
        client = connect(peer.endpoint(), "delivery")  # patience 30 s
        op, args, buffers, _ = SPECS["delivery"].ops[0]
        started = time.monotonic()
        with pytest.raises(WireBroken, match="no answer in 0.3 s"):
            client.call(op, args, buffers, within=0.3)
        took = time.monotonic() - started
    finally:
        peer.close()
    assert 0.3 <= took < 10.0  # the bound, not the 30 s patience


#: The busy-server tests' patience (seconds): short, so that pings come soon, but not so
#: short that a process stalled on a loaded machine misses a ping's answer (each
#: answered ping is then a second wait past the patience).
PING_PATIENCE_SECONDS = 0.3


@pytest.mark.parametrize("name", HELD)
def test_a_busy_server_answers_pings_and_its_client_waits_past_its_patience(name):
    async def main():
        async with serving(name) as s:
            client, waiting = await held_call(s, name, patience=PING_PATIENCE_SECONDS)
            await until(lambda: s.wire.pings_answered >= 2, "two pings answered")
            assert not waiting.done()
            s.backend.gate.set()
            answer = await waiting
            assert client.broken is None
            client.close()
            return answer

    assert run(main()).value is not None


@pytest.mark.parametrize("name", HELD)
def test_a_server_killed_mid_request_fails_it_answer_pending(name):
    async def main():
        async with serving(name) as s:
            _client, waiting = await held_call(s, name)
            (conn,) = s.wire._open
            conn.transport.abort()  # the server's process dies
            with pytest.raises(WireBroken) as broken:
                await waiting
            assert broken.value.answer_pending
            s.backend.gate.set()

    run(main())


@pytest.mark.parametrize("name", HELD)
def test_close_from_another_thread_ends_a_waiting_call_at_once(name):
    async def main():
        async with serving(name) as s:
            client, waiting = await held_call(s, name)
            started = time.monotonic()
            client.close()  # this thread is not the one reading
            with pytest.raises(WireBroken, match="closed") as broken:
                await waiting
            assert broken.value.answer_pending
            s.backend.gate.set()
            return time.monotonic() - started

    assert run(main()) < WAIT_SECONDS / 3  # at once, not at a timeout


@pytest.mark.parametrize(
    "reply",
    [
        b"\x00\x00\x00\x02\x91\x01",  # a header that is not a list of four
        b"".join(bytes(p) for p in frames.encode([1, "not [name, message]", None])),
    ],
)
def test_an_answer_that_is_not_one_breaks_the_connection(reply):
    listener = socket.create_server(("127.0.0.1", 0))

    def peer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(READ_SECONDS)
            exactly(conn, int.from_bytes(exactly(conn, 4), "big"))  # the hello
            conn.sendall(b"".join(bytes(p) for p in frames.encode([0, None, {}])))
            exactly(conn, int.from_bytes(exactly(conn, 4), "big"))  # the request
            conn.sendall(reply)
            conn.recv(1)  # until the client closes

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    try:
        client = connect(("127.0.0.1", listener.getsockname()[1], "s" * 32), "delivery")
        with pytest.raises(WireBroken, match="nonsense") as broken:
            client.call("take", [1, 0.0])
        assert broken.value.answer_pending and client.broken is not None
    finally:
        thread.join(READ_SECONDS)
        listener.close()
