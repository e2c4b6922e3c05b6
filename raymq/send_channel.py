"""SendChannel: sends over a socket to the queue actor, not a Ray call each.

A Ray actor call costs 1-2 ms of round trip here (docs/ARCHITECTURE.md). A producer that
sends one message at a time and waits for each is bound by that round trip, however
well the actor's group commit shares fsyncs: 8 such producers top out near 8 / 1.7 ms.
And a batch as a Ray argument goes through the object store: the producer's Ray core
spent ~6 ms of CPU per 1 MiB batch here (creating, copying and freeing the object with
the raylet), more than packing it and the queue's write and fsync together.
So a queue actor also listens on a TCP socket on its node's address; each client process
keeps one connection per queue and sends single messages and batches over it, many in
flight at once. Consumers and everything else go through Ray.

Security: the socket answers only a client that first presents the queue actor's secret,
which a client gets through an (authenticated) Ray call, within ``HELLO_TIMEOUT_SECONDS``
(compared in constant time). Frames are limited in size, and before the secret is shown
to 1 KiB; a queue actor serves at most ``MAX_CONNECTIONS`` connections at once. Every
request is checked where it enters (ids integers, timeouts numbers or nil, bodies and
properties bytes, properties a valid msgpack map): a bad one gets its error and takes
no other request of the same gather with it.

Frames: a 4-byte big-endian length, then msgpack. The client's first frame is
``[secret]``, answered ``[true]``. Then requests, answered in any order:

- a ping: ``[id]``, answered ``[id, true, nil, nil]`` (a client waiting long for an
  answer asks it to tell a busy queue from a dead connection);
- one message: ``[id, body, properties, timeout]`` (properties msgpack-encoded as in a
  MessageBatch, timeout seconds or nil), answered ``[id, offset, nil, nil]`` (offset
  nil: DROPped);
- a batch: ``[id, timeout, [n0, n1, n2, n3]]`` followed by four raw buffers of those
  lengths in bytes: a ``MessageBatch``'s body offsets (little-endian int64), body bytes,
  property offsets and property bytes (``MessageBatch.wire_buffers``), answered
  ``[id, [first offset, count stored], nil, nil]``;

or, for either, ``[id, nil, error class name, message]``. A server that stopped
serving (its queue hibernates or stops) answers ``NotLeader`` and then closes.

The server (``raymq.send_channel_server``) parses frames in the event-loop callback that
receives their bytes (an asyncio Protocol, not a stream reader: no task is woken per
request), and gathers the requests that arrive together into one ``MessageBatch`` (one
record on disk, one group commit), as a client's producer (``raymq.client.producer``)
gathers its threads' sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import socket
import struct
import sys
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11
from typing import Any

import msgpack

from raymq import errors
from raymq.batch import MessageBatch

log = logging.getLogger("raymq.send_channel")

_LENGTH = struct.Struct(">I")
#: Room for a request's framing beside its body and properties (bytes).
FRAME_OVERHEAD = 64 * 1024
#: Seconds a client waits to connect and for the server's answer to its secret.
CONNECT_TIMEOUT_SECONDS = 5.0
#: A client waiting this long for an answer pings the server; a ping unanswered as long
#: again breaks the channel (seconds). A BLOCKed send may wait for ever, a dead peer not.
REPLY_PATIENCE_SECONDS = 30.0
#: Longest a client's write may wait for the server to take bytes (seconds): a peer
#: that reads nothing for that long (its process paused, a partition) breaks the
#: channel, and the sends go again by Ray, where a write could otherwise wait for ever
#: holding the channel's lock (and with it every sender and the liveness ping).
SEND_TIMEOUT_SECONDS = REPLY_PATIENCE_SECONDS
#: A request whose parts (header and buffers) total at most this is joined and written
#: in one system call; a larger one is written part by part, without a copy (bytes).
JOIN_WRITE_BYTES = 64 * 1024
#: An asyncio send larger than this is written from a worker thread, not the event
#: loop's (bytes).
ASYNC_INLINE_WRITE_BYTES = 2**20


class ChannelBroken(ConnectionError):
    """The connection failed; the send may or may not have been stored (retry it)."""


def frame(obj: object) -> bytes:
    """``obj`` as one frame: length, then msgpack."""
    payload = msgpack.packb(obj, use_bin_type=True)
    return _LENGTH.pack(len(payload)) + payload


def error_of(name: str, message: str) -> Exception:
    """The typed error a server named (RayMQ's, TypeError or ValueError)."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.RayMQError):
        return cls(message)
    if name == "TypeError":
        return TypeError(message)
    if name == "ValueError":
        return ValueError(message)
    return errors.RayMQError(f"{name}: {message}")


# -- the queue actor's side -------------------------------------------------------------

SendBatch = Callable[[MessageBatch, "float | None"], Awaitable[tuple[int, int]]]


def unix_address(secret: str) -> str | None:
    """The abstract Unix socket (Linux) a server with ``secret`` also listens on: named
    after a hash of the secret (names are visible to local users; the secret is not).
    None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    return "\0raymq-send-" + hashlib.sha256(secret.encode()).hexdigest()[:32]


def _connect(host: str, port: int, secret: str) -> socket.socket:
    """A connection to the server: its Unix socket when it runs on this machine (a round
    trip costs about half of TCP's over loopback), else TCP to (host, port)."""
    address = unix_address(secret)
    if address is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_SECONDS)
        try:
            sock.connect(address)
            return sock
        except OSError:  # another machine (or network namespace): TCP
            sock.close()
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_SECONDS)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# -- the client's side -------------------------------------------------------------------


class _Reply:
    """The answer to one request, which one thread waits for and another sets once: a
    ``concurrent.futures.Future`` without its Condition (whose lock the woken sender
    had to take again from the reader thread: a second hand-off for every message)."""

    __slots__ = ("_pending", "_value", "_error")

    def __init__(self) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()  # released once, by set_result or set_exception
        self._value: Any = None
        self._error: BaseException | None = None

    def set_result(self, value: Any) -> None:
        self._value = value
        self._pending.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._pending.release()

    def done(self) -> bool:
        return not self._pending.locked()

    def result(self, timeout: float | None = None) -> Any:
        """The answer (or its error raised) once set; ``FutureTimeout`` after
        ``timeout`` seconds (None: wait for ever)."""
        if self._pending.locked():
            if not self._pending.acquire(timeout=-1 if timeout is None else timeout):
                raise FutureTimeout()
            self._pending.release()  # set stays set: later calls return at once
        if self._error is not None:
            raise self._error
        return self._value


class _AsyncReply:
    """A reply an asyncio task awaits: set from the reader thread, it wakes the task on
    its own loop (``call_soon_threadsafe``), never blocking the loop. The answer is kept
    in ``answer`` and ``future`` only wakes the awaiter (which may also be woken by its
    patience running out: it then pings, and waits on a new ``future``)."""

    __slots__ = ("_loop", "future", "answer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.answer: tuple[Any, BaseException | None] | None = None

    def set_result(self, value: Any) -> None:
        self._call_soon(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._call_soon(None, error)

    def _call_soon(self, value: Any, error: BaseException | None) -> None:
        if self._loop.is_closed():  # its awaiter went with its loop (a timed-out
            return  # send in an ``asyncio.run`` that ended): nobody to tell
        self._loop.call_soon_threadsafe(self._resolve, value, error)

    def _resolve(self, value: Any, error: BaseException | None) -> None:
        self.answer = (value, error)
        self.wake()

    def wake(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


def _tell(reply: Any, value: Any, error: BaseException | None) -> None:
    """Give a reply its answer; one that cannot take it (its asyncio loop closed, its
    awaiter gone) is logged and left, never breaking the channel nor the replies after
    it."""
    try:
        if error is None:
            reply.set_result(value)
        else:
            reply.set_exception(error)
    except Exception:
        log.warning("send channel: a reply could not be told its answer", exc_info=True)


class SendChannel:
    """One connection of this process to one queue actor, shared by its threads.

    ``send`` may be called from many threads at once; a reader thread hands each answer
    to the sender waiting for it. Once broken (the actor restarted, the network failed)
    it stays broken: every waiting and later ``send`` raises ``ChannelBroken``.

    Besides the waiting ``send`` and ``send_batch``, ``submit_batch`` sends without
    waiting: the answer goes to a reply object's ``set_result`` /
    ``set_exception`` (called from the reader thread, or from whichever thread found
    the channel broken, never with the channel's lock held).
    """

    def __init__(self, host: str, port: int, secret: str, queue: str):
        self.queue = queue
        sock = _connect(host, port, secret)
        try:
            sock.sendall(frame([secret]))
            self._file = sock.makefile("rb")
            if self._read() != [True]:
                raise ChannelBroken(f"queue {queue!r} refused the send channel")
            sock.settimeout(None)
            # Writes only (the reader thread waits on this socket for as long as need be).
            seconds = int(SEND_TIMEOUT_SECONDS)
            micros = int((SEND_TIMEOUT_SECONDS - seconds) * 1e6)
            timeval = struct.pack("ll", seconds, micros)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._lock = threading.Lock()
        self._waiting: dict[int, Any] = {}  # request id -> reply (set_result/set_exception)
        self._ids = itertools.count()
        self.broken: BaseException | None = None
        self._reader = threading.Thread(
            target=self._read_loop, name=f"raymq-send-{queue}", daemon=True
        )
        self._reader.start()

    def send(self, body: bytes, properties: bytes, timeout: float | None) -> int | None:
        """Store one message; returns its offset once durable (None: DROPped).

        Raises the queue's typed error, or ``ChannelBroken`` if the connection failed
        (the message may have been stored: at-least-once, as any retried send)."""
        return self._request(lambda req_id: [frame([req_id, body, properties, timeout])])

    def send_batch(self, batch: MessageBatch, timeout: float | None) -> tuple[int, int]:
        """Store a batch; returns (first offset, count stored) once durable. Errors as
        ``send``."""
        first, count = self._request(self._batch_parts(batch, timeout))
        return first, count

    def submit_one(self, body: bytes, properties: bytes, timeout: float | None, reply: Any) -> None:
        """Send one message without waiting: ``reply.set_result(offset)`` (None:
        DROPped) once durable, or ``reply.set_exception(error)``. ``ChannelBroken`` at
        once (``reply`` not called) if the channel is broken."""
        self._submit(lambda req_id: [frame([req_id, body, properties, timeout])], reply)

    def submit_batch(self, batch: MessageBatch, timeout: float | None, reply: Any) -> None:
        """Send a batch without waiting: ``reply.set_result([first offset, count
        stored])`` once durable, or ``reply.set_exception(error)``. Raises
        ``ChannelBroken`` at once (and ``reply`` is not called) if the channel is broken."""
        self._submit(self._batch_parts(batch, timeout), reply)

    async def send_batch_async(self, batch: MessageBatch, timeout: float | None) -> tuple[int, int]:
        """``send_batch`` for asyncio code: awaits the answer without blocking the loop."""
        first, count = await self._request_async(self._batch_parts(batch, timeout), batch.nbytes)
        return first, count

    async def send_async(self, body: bytes, properties: bytes, timeout: float | None) -> int | None:
        """``send`` for asyncio code."""
        parts = lambda req_id: [frame([req_id, body, properties, timeout])]  # noqa: E731
        return await self._request_async(parts, len(body))

    @staticmethod
    def _batch_parts(batch: MessageBatch, timeout: float | None) -> Callable[[int], list]:
        buffers = [memoryview(b).cast("B") for b in batch.wire_buffers()]
        lengths = [b.nbytes for b in buffers]
        return lambda req_id: [frame([req_id, timeout, lengths]), *buffers]

    def _request(self, parts_of: Callable[[int], list]) -> Any:
        """Send the frame ``parts_of(request id)`` and wait for its answer: as long as
        the server answers pings (a BLOCKed send may wait for ever), else
        ``ChannelBroken`` after ``REPLY_PATIENCE_SECONDS`` twice."""
        fut = _Reply()
        self._submit(parts_of, fut)
        while True:
            try:
                return fut.result(timeout=REPLY_PATIENCE_SECONDS)
            except FutureTimeout:
                pass
            self.check_alive()
            if fut.done():
                return fut.result()

    async def _request_async(self, parts_of: Callable[[int], list], nbytes: int) -> Any:
        """``_request`` for asyncio code. A large request is written from a worker thread
        (a blocking ``sendall`` of many MiB would stall the event loop)."""
        loop = asyncio.get_running_loop()
        reply = _AsyncReply(loop)
        if nbytes > ASYNC_INLINE_WRITE_BYTES:
            await asyncio.to_thread(self._submit, parts_of, reply)
        else:
            self._submit(parts_of, reply)
        while True:
            # A timer, not wait_for(shield(...)): fewer objects and callbacks per send.
            patience = loop.call_later(REPLY_PATIENCE_SECONDS, reply.wake)
            try:
                await reply.future
            finally:
                patience.cancel()
            if reply.answer is None:  # patience ran out: is the server alive?
                reply.future = loop.create_future()
                await asyncio.to_thread(self.check_alive)
                if reply.answer is None:
                    continue
            value, error = reply.answer
            if error is not None:
                raise error
            return value

    def check_alive(self) -> bool:
        """Ping the server and wait up to ``REPLY_PATIENCE_SECONDS`` for the answer;
        unanswered, the channel breaks (failing every waiting request with
        ``ChannelBroken``). Returns False if the channel is (now) broken."""
        ping = _Reply()
        try:
            self._submit(lambda req_id: [frame([req_id])], ping)
            ping.result(timeout=REPLY_PATIENCE_SECONDS)
            return True
        except FutureTimeout:
            self._break(TimeoutError(f"no answer to a ping in {REPLY_PATIENCE_SECONDS} s"))
        except ChannelBroken:
            pass
        return False

    def _submit(self, parts_of: Callable[[int], list], reply: Any) -> None:
        """Send the frame ``parts_of(request id)``; its answer goes to ``reply``."""
        with self._lock:
            if self.broken is not None:
                raise ChannelBroken(f"send channel of queue {self.queue!r}: {self.broken}")
            req_id = next(self._ids)
            self._waiting[req_id] = reply
            try:
                parts = parts_of(req_id)
                if len(parts) == 1:
                    self._sock.sendall(parts[0])
                elif sum(len(p) for p in parts) <= JOIN_WRITE_BYTES:
                    self._sock.sendall(b"".join(parts))  # one system call, not five
                else:
                    for part in parts:  # large: no copy
                        self._sock.sendall(part)
                return
            except BaseException as exc:  # (a KeyboardInterrupt too: part of a frame may
                # be written, and the next frame would be read as its rest)
                self._waiting.pop(req_id, None)
                error = exc
        self._break(error)  # outside the lock: replies may take locks of their own
        if not isinstance(error, Exception):
            raise error
        raise ChannelBroken(f"send channel of queue {self.queue!r}: {error}") from error

    def close(self) -> None:
        """Close the connection; waiting sends raise ``ChannelBroken``. Shut down first:
        ``close`` alone leaves the reader's file open, and with it the connection and
        the reader thread blocked on it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()

    def _read(self) -> object:
        head = self._file.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            raise ChannelBroken("connection closed")
        (n,) = _LENGTH.unpack(head)
        payload = self._file.read(n)
        if len(payload) < n:
            raise ChannelBroken("connection closed")
        return msgpack.unpackb(payload, raw=False)

    def _read_loop(self) -> None:
        try:
            while True:
                req_id, offset, error, message = self._read()
                with self._lock:
                    fut = self._waiting.pop(req_id, None)
                if fut is None:
                    continue
                answer = None if error is None else error_of(error, message)
                _tell(fut, offset, answer)
        except Exception as exc:  # whatever ends the reader breaks the channel
            self._break(exc)

    def _break(self, exc: BaseException) -> None:
        """Mark broken and fail every waiting request (call without the lock: the
        replies are told outside it, in the order they were sent)."""
        with self._lock:
            if self.broken is None:
                self.broken = exc
            waiting, self._waiting = self._waiting, {}
            self.close()
        for fut in waiting.values():  # ids ascend: dict order is the order sent
            _tell(fut, None, ChannelBroken(f"send channel of queue {self.queue!r}: {exc}"))
