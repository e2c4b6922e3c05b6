"""DeliveryChannel: a consumer's receives over a socket to its TargetList actor.

Through Ray, a message the TargetList holds reaches the application in two hops of
1-2 ms each here (ARCHITECTURE.md): the client's ``take`` call returns references, then
``ray.get`` of a reference borrowed from the TargetList asks that actor for it. So the
TargetList actor also listens on a TCP socket on its node's address (the consumer's
node), and its consumer's ``receive`` asks there: the answer carries the messages
themselves as an Arrow IPC stream, read by the client without a further copy.

A large answer (more than ``INLINE_BYTES`` ready for one receive, as for a tuned
``receive_batch(1000)`` on a deep queue) is not copied through the socket: the server
answers "by reference" and the client takes those rows through Ray as before, read
from the object store without a copy. The channel only changes how messages travel
from the TargetList to the client: the TargetList still holds the consumer's direct
references, its watermark and PendingCache, and the queue its prefetch accounting.

Failures: a client that cannot connect, or whose connection breaks, goes back to the
Ray path for good (``ChannelBroken``; counted and logged by the consumer). Rows the
server took for an answer it could not write are given back to the queue (never
received). An answer lost after it was written (the client gave up waiting) stays
held by the consumer until it closes or dies, when the queue delivers it again.

Security: as the SendChannel, the server answers only a client that first presents
its secret (got through an authenticated Ray call), within ``HELLO_TIMEOUT_SECONDS``;
frames before it are limited to 1 KiB, requests to ``REQUEST_LIMIT`` bytes.

Frames: a 4-byte big-endian length, then msgpack. The client's first frame is
``[secret]``, answered ``[true]``. A request is ``[max_messages, timeout]`` (messages,
seconds), one at a time per connection, answered with one of

- ``["batch", n]`` followed by ``n`` raw bytes: an Arrow IPC stream of one delivery
  RecordBatch (``raymq.batch.DELIVERY_SCHEMA``);
- ``["none", 0]``: nothing arrived within the timeout;
- ``["ray", 0]``: more than ``INLINE_BYTES`` are ready: take them through Ray;
- ``["error", class name, message]``: the typed error ``receive`` raises.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Awaitable, Callable

import msgpack
import pyarrow as pa

from raymq.errors import RayMQError
from raymq.send_channel import error_of

log = logging.getLogger("raymq.delivery_channel")

_LENGTH = struct.Struct(">I")
#: Largest answer sent inline through the socket (bytes); more goes by reference
#: through Ray and the object store, without a copy.
INLINE_BYTES = 256 * 1024
#: Longest first frame (the secret) the server reads from an unknown peer (bytes).
HELLO_LIMIT = 1024
#: Longest request frame (bytes).
REQUEST_LIMIT = 1024
#: Longest answer header a client reads (bytes).
HEADER_LIMIT = 64 * 1024
#: Seconds a client waits to connect and for the server's answer to its secret.
CONNECT_TIMEOUT_SECONDS = 5.0
#: Seconds a server waits for a new connection's secret before closing it.
HELLO_TIMEOUT_SECONDS = 5.0
#: Seconds a client waits for an answer beyond the timeout it asked the server for:
#: past that the channel is taken as broken and the Ray path used.
ANSWER_MARGIN_SECONDS = 15.0
#: Longest wait one request may ask for (seconds); the client asks again.
MAX_WAIT_SECONDS = 60.0
#: Connections one server serves at once (one consumer; a few for reconnects).
MAX_CONNECTIONS = 4

BY_REFERENCE = "ray"
#: Consumers open a DeliveryChannel; False makes new consumers receive through Ray
#: calls only (``bench/latency.py`` measures that path beside it, as its baseline).
USE_CHANNEL = True


class ChannelBroken(ConnectionError):
    """The connection failed or answered nonsense; use the Ray path."""


def frame(obj: object) -> bytes:
    """``obj`` as one frame: length, then msgpack."""
    payload = msgpack.packb(obj, use_bin_type=True)
    return _LENGTH.pack(len(payload)) + payload


def to_ipc(batch: pa.RecordBatch) -> pa.Buffer:
    """``batch`` as an Arrow IPC stream (a slice writes only its rows)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def from_ipc(data: bytes | bytearray | memoryview) -> pa.RecordBatch:
    """The one RecordBatch of an IPC stream (its buffers point into ``data``)."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()


# -- the TargetList actor's side -----------------------------------------------------------

#: ``take(max_messages, timeout, inline_bytes)``: a RecordBatch of up to
#: ``max_messages`` (None if nothing came in ``timeout`` seconds), or ``BY_REFERENCE``
#: when more than ``inline_bytes`` are ready; raises the typed error ``receive`` raises.
Take = Callable[[int, float, int], Awaitable["pa.RecordBatch | str | None"]]
#: ``give_back(batch)``: rows taken for an answer that could not be written.
GiveBack = Callable[[pa.RecordBatch], Awaitable[None]]


class DeliveryChannelServer:
    """Serves one consumer's receives from its TargetList actor's event loop."""

    def __init__(self, take: Take, give_back: GiveBack, what: str):
        self._take = take
        self._give_back = give_back
        self._what = what  # "consumer <id> of queue <name>", for logs
        self.secret = secrets.token_hex(16)
        self._server: asyncio.AbstractServer | None = None
        self.connections = 0
        self.answers = 0  # answered with messages inline
        self.by_reference = 0  # answered "take them through Ray"
        self.given_back = 0  # messages of answers that could not be written

    async def start(self, host: str) -> tuple[str, int, str]:
        """Listen on ``host`` (a free port); returns (host, port, secret)."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return host, port, self.secret

    def close(self) -> None:
        """Stop listening (open connections end with the actor)."""
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= MAX_CONNECTIONS:
            writer.close()
            return
        self.connections += 1
        try:
            hello = await asyncio.wait_for(_read_frame(reader, HELLO_LIMIT), HELLO_TIMEOUT_SECONDS)
            if not (
                isinstance(hello, list)
                and len(hello) == 1
                and isinstance(hello[0], str)
                and hmac.compare_digest(hello[0].encode(), self.secret.encode())
            ):
                return
            writer.write(frame([True]))
            while True:
                req = await _read_frame(reader, REQUEST_LIMIT)
                if not _valid(req):
                    return  # not our client: drop the connection
                await self._answer(writer, int(req[0]), float(req[1]))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, ValueError):
            pass  # the client went away, or never showed the secret
        except Exception:  # msgpack garbage and the like: drop that connection only
            log.exception("%s: delivery channel connection failed", self._what)
        finally:
            self.connections -= 1
            writer.close()

    async def _answer(
        self, writer: asyncio.StreamWriter, max_messages: int, timeout: float
    ) -> None:
        try:
            got = await self._take(max_messages, min(timeout, MAX_WAIT_SECONDS), INLINE_BYTES)
        except RayMQError as exc:
            writer.write(frame(["error", type(exc).__name__, str(exc)]))
            await writer.drain()
            return
        if got is None:
            writer.write(frame(["none", 0]))
        elif isinstance(got, str):
            self.by_reference += 1
            writer.write(frame([BY_REFERENCE, 0]))
        else:
            try:
                data = to_ipc(got)
                writer.write(frame(["batch", data.size]))
                writer.write(memoryview(data))
                await writer.drain()
            except BaseException:  # the client went away, or a bug: not lost either way
                # Not handed to the application: the queue delivers them again (uncounted).
                self.given_back += got.num_rows
                log.warning(
                    "%s: delivery channel broke; %d messages given back",
                    self._what,
                    got.num_rows,
                )
                await self._give_back(got)
                raise
            self.answers += 1
            return
        await writer.drain()


def _valid(req: object) -> bool:
    return (
        isinstance(req, list)
        and len(req) == 2
        and type(req[0]) is int
        and req[0] >= 1
        and isinstance(req[1], int | float)
        and not isinstance(req[1], bool)
        and req[1] >= 0
    )


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> object:
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if n > limit:
        raise ValueError(f"frame of {n} bytes over the limit of {limit}")
    return msgpack.unpackb(await reader.readexactly(n), raw=False)


# -- the consumer's side ---------------------------------------------------------------------


class DeliveryChannel:
    """A consumer's connection to its TargetList actor's ``DeliveryChannelServer``.

    Thread-safe (one request at a time). Any failure raises ``ChannelBroken`` and
    leaves the channel closed: the caller uses the Ray path from then on.
    """

    def __init__(self, host: str, port: int, secret: str, queue: str):
        self.queue = queue
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_SECONDS)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(frame([secret]))
            if self._read_frame(HEADER_LIMIT) != [True]:
                raise ChannelBroken(f"queue {queue!r}: the delivery channel refused us")
        except (OSError, ValueError) as exc:
            self.close()
            raise ChannelBroken(f"queue {queue!r}: no delivery channel: {exc!r}") from exc

    def take(self, max_messages: int, timeout: float) -> pa.RecordBatch | str | None:
        """Up to ``max_messages`` messages, waiting up to ``timeout`` seconds for the
        first: a RecordBatch, None if none came, or ``BY_REFERENCE`` (take them through
        Ray). Raises the queue's typed error, or ``ChannelBroken``."""
        timeout = min(max(timeout, 0.0), MAX_WAIT_SECONDS)
        with self._lock:
            if self._closed:
                raise ChannelBroken(f"queue {self.queue!r}: the delivery channel is closed")
            try:
                self._sock.settimeout(timeout + ANSWER_MARGIN_SECONDS)
                self._sock.sendall(frame([max_messages, timeout]))
                head = self._read_frame(HEADER_LIMIT)
                kind = head[0] if isinstance(head, list) and head else None
                if kind == "batch":
                    return from_ipc(self._read_exactly(int(head[1])))
                if kind == "none":
                    return None
                if kind == BY_REFERENCE:
                    return BY_REFERENCE
                if kind == "error" and len(head) == 3:
                    error = error_of(str(head[1]), str(head[2]))
                else:
                    raise ValueError(f"unexpected answer {head!r:.200}")
            except (OSError, ValueError, IndexError, TypeError, msgpack.UnpackException) as exc:
                self._close_locked()
                raise ChannelBroken(f"queue {self.queue!r}: delivery channel: {exc!r}") from exc
        raise error

    def close(self) -> None:
        """Close the connection (the server sees the end of it)."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        self._closed = True
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()

    def _read_exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("the TargetList closed the delivery channel")
            got += k
        return buf

    def _read_frame(self, limit: int) -> object:
        (n,) = _LENGTH.unpack(bytes(self._read_exactly(_LENGTH.size)))
        if n > limit:
            raise ValueError(f"frame of {n} bytes over the limit of {limit}")
        return msgpack.unpackb(bytes(self._read_exactly(n)), raw=False)
