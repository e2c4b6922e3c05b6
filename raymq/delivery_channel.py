"""DeliveryChannel: a consumer's receives over a socket to its TargetList actor.

Through Ray, a message the TargetList holds reaches the application in two hops of
1-2 ms each here (docs/ARCHITECTURE.md): the client's ``take`` call returns references, then
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
received). A client whose connection broke with a request under way tells the
TargetList how many answers with messages it read whole
(``TargetListActor.channel_broke``): the rows of any answer written beyond those, or
written on that connection from then on, are given back too. Without that call (the
client died, say) an answer lost after it was written stays held by the consumer until
it closes or dies, when the queue delivers it again.

Security: as the SendChannel, the server answers only a client that first presents
its secret (got through an authenticated Ray call), within ``HELLO_TIMEOUT_SECONDS``;
frames before it are limited to 1 KiB, requests to ``REQUEST_LIMIT`` bytes.

Starting: a new consumer takes a warm spare TargetList whose channel listens already
(``raymq.placement.spares``), connects, and starts it with its first request rather
than a Ray call: a call and its answer cost a new consumer's first message 4-5 ms here
(measured), a request on the socket well under 1 ms.

Frames: a 4-byte big-endian length, then msgpack. The client's first frame is
``[secret]``, answered ``[true]``. The first request may be ``["start", settings]``
(``settings``: ``TargetListActor.start``'s arguments by name; at most ``START_LIMIT``
bytes), answered ``["started", what start returned]`` or an error as below. A request
is ``[max_messages, timeout]`` (messages, seconds), one at a time per connection,
answered with one of

- ``["batch", n]`` followed by ``n`` raw bytes: an Arrow IPC stream of one delivery
  RecordBatch (``raymq.batch.DELIVERY_SCHEMA``). A delivery that reached the
  TargetList inline over its FetchChannel and is taken whole goes on in the stream it
  came in (``Encoded``), not decoded and encoded again;
- ``["none", 0]``: nothing arrived within the timeout;
- ``["ray", 0]``: more than ``INLINE_BYTES`` are ready: take them through Ray;
- ``["error", class name, message]``: the typed error ``receive`` raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import msgpack
import pyarrow as pa

from raymq.errors import RayMQError
from raymq.selector.parser import MAX_SELECTOR_LENGTH
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
#: Longest start request (bytes): the longest selector (4 bytes a character at most in
#: UTF-8) and the other settings.
START_LIMIT = 4 * MAX_SELECTOR_LENGTH + 16 * 1024
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

    #: The break came after a request was sent: the server may have taken (and
    #: written) an answer's rows that the client never read.
    answer_pending: bool = False


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


class Encoded(NamedTuple):
    """An answer's rows as the IPC stream they came in (``stream``: one RecordBatch,
    ``to_ipc``'s layout), written as it is; ``rows`` is that RecordBatch (for counts and
    give-backs)."""

    rows: pa.RecordBatch
    stream: bytes | bytearray | memoryview


def answer_of(parts: list[tuple[pa.RecordBatch, bytes | None]]) -> pa.RecordBatch | Encoded:
    """A DeliveryChannel answer of ``parts``, in order: (rows, the IPC stream they came in
    over the FetchChannel when they are all of it, else None). One delivery taken whole
    goes on as it came (``Encoded``): not decoded and encoded again. Otherwise one
    RecordBatch, which the server encodes: splicing several streams' record batch
    messages into one cost the TargetList and the client more than a concatenation and
    one encoding (3 deliveries of 10-100 x 1 KiB: 28-32 µs against 15-31 µs, and the
    client's read 19-24 µs against 10-13 µs; one whole delivery: 1 µs against 7-14 µs;
    measured)."""
    if len(parts) == 1 and parts[0][1] is not None:
        rows, stream = parts[0]
        return Encoded(rows, stream)
    rows = [r for r, _ in parts]
    return rows[0] if len(rows) == 1 else pa.concat_batches(rows)


class SecretServer:
    """A listening socket whose clients must show its ``secret`` first, at most
    ``max_connections`` at a time: the DeliveryChannel's and the FetchChannel's servers.
    A subclass's ``_serve`` admits a connection with ``_admit`` and, if it did, greets
    it with ``_greet`` and ends with ``_leave``."""

    max_connections = MAX_CONNECTIONS

    def __init__(self) -> None:
        self.secret = secrets.token_hex(16)
        self._server: asyncio.AbstractServer | None = None
        self.connections = 0

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
        raise NotImplementedError

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """Count a new connection in, or close it if ``max_connections`` are open."""
        if self.connections >= self.max_connections:
            writer.close()
            return False
        self.connections += 1
        return True

    async def _greet(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read the client's hello (within ``HELLO_TIMEOUT_SECONDS``): True, answered,
        if it shows the secret; False (say nothing, drop it) if not."""
        hello = await asyncio.wait_for(_read_frame(reader, HELLO_LIMIT), HELLO_TIMEOUT_SECONDS)
        if not (
            isinstance(hello, list)
            and len(hello) == 1
            and isinstance(hello[0], str)
            and hmac.compare_digest(hello[0].encode(), self.secret.encode())
        ):
            return False
        nodelay(writer)
        writer.write(frame([True]))
        return True

    def _leave(self, writer: asyncio.StreamWriter) -> None:
        """An admitted connection ends."""
        self.connections -= 1
        writer.close()


def nodelay(writer: asyncio.StreamWriter) -> None:
    """Small answers leave at once (no Nagle delay) on a TCP connection."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- the TargetList actor's side -----------------------------------------------------------

#: ``take(max_messages, timeout, inline_bytes)``: up to ``max_messages`` as a RecordBatch
#: or ``Encoded`` (None if nothing came in ``timeout`` seconds), or ``BY_REFERENCE``
#: when more than ``inline_bytes`` are ready; raises the typed error ``receive`` raises.
Take = Callable[[int, float, int], Awaitable["pa.RecordBatch | Encoded | str | None"]]
#: ``give_back(batch)``: rows taken for an answer that could not be written.
GiveBack = Callable[[pa.RecordBatch], Awaitable[None]]
#: ``start(settings)``: ``TargetListActor.start`` by keyword: what it returns; raises a
#: typed error (``RayMQError``, ``TypeError``, ``ValueError``) for the client.
Start = Callable[[dict], Awaitable[object]]


class _Connection:
    """One client connection: answers with messages written on it (counted), the last
    one kept until the client's next request shows it was read, and what the client
    said it read once the connection broke (``give_back_unread``)."""

    __slots__ = ("written", "unconfirmed", "abandoned", "read")

    def __init__(self) -> None:
        self.written = 0
        self.unconfirmed: list[tuple[int, pa.RecordBatch]] = []
        self.abandoned = False
        self.read = 0  # answers the client read whole, as it said after the break

    def unread(self) -> list[pa.RecordBatch]:
        """Answers written beyond those read, forgotten here (given back by the caller)."""
        out = [batch for index, batch in self.unconfirmed if index > self.read]
        self.unconfirmed = [(i, b) for i, b in self.unconfirmed if i <= self.read]
        return out


class DeliveryChannelServer(SecretServer):
    """Serves one consumer's receives from its TargetList actor's event loop."""

    def __init__(self, take: Take, give_back: GiveBack, what: str, start: Start | None = None):
        super().__init__()
        self._take = take
        self._give_back = give_back
        self._start = start
        self.what = what  # "consumer <id> of queue <name>", for logs
        self.answers = 0  # answered with messages inline
        self.by_reference = 0  # answered "take them through Ray"
        self.given_back = 0  # messages of answers that could not be written, or unread
        self._latest: _Connection | None = None  # the client's connection (it has one)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            return
        try:
            if not await self._greet(reader, writer):
                return
            conn = self._latest = _Connection()
            limit = START_LIMIT if self._start is not None else REQUEST_LIMIT
            while True:
                req = await _read_frame(reader, limit)
                if limit == START_LIMIT and _is_start(req):
                    await self._answer_start(writer, req[1])
                    continue
                limit = REQUEST_LIMIT  # a start comes first, or not at all
                if not _valid(req):
                    return  # not our client: drop the connection
                conn.unconfirmed.clear()  # a request comes only after the answer was read
                await self._answer(writer, int(req[0]), float(req[1]), conn=conn)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass  # the client went away, or never showed the secret
        except Exception:  # msgpack garbage and the like: drop that connection only
            log.exception("%s: delivery channel connection failed", self.what)
        finally:
            self._leave(writer)

    async def _answer_start(self, writer: asyncio.StreamWriter, settings: dict) -> None:
        """Start the TargetList (once per connection, as its first request)."""
        assert self._start is not None
        try:
            got = await self._start(settings)
        except (RayMQError, TypeError, ValueError) as exc:
            writer.write(frame(["error", type(exc).__name__, str(exc)]))
        else:
            writer.write(frame(["started", got]))
        await writer.drain()

    async def give_back_unread(self, answers_read: int) -> int:
        """The client's connection broke with a request under way, after it read
        ``answers_read`` answers with messages whole: give back the rows of any answer
        written beyond those (never received), and of any written from now on; returns
        how many messages."""
        conn = self._latest
        if conn is None:
            return 0
        conn.abandoned, conn.read = True, answers_read
        return await self._give_back_unread(conn)

    async def _give_back_unread(self, conn: _Connection) -> int:
        batches = conn.unread()
        n = sum(batch.num_rows for batch in batches)
        if n:
            self.given_back += n
            log.warning(
                "%s: delivery channel broke; %d messages it wrote unread given back", self.what, n
            )
        for batch in batches:
            await self._give_back(batch)
        return n

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        max_messages: int,
        timeout: float,
        *,
        conn: _Connection | None = None,
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
            got, data = (got.rows, got.stream) if isinstance(got, Encoded) else (got, to_ipc(got))
            try:
                view = memoryview(data)
                writer.write(frame(["batch", view.nbytes]))
                writer.write(view)
                await writer.drain()
            except BaseException:  # the client went away, or a bug: not lost either way
                # Not handed to the application: the queue delivers them again (uncounted).
                self.given_back += got.num_rows
                log.warning(
                    "%s: delivery channel broke; %d messages given back",
                    self.what,
                    got.num_rows,
                )
                await self._give_back(got)
                raise
            self.answers += 1
            if conn is not None:
                conn.written += 1
                conn.unconfirmed.append((conn.written, got))
                if conn.abandoned:  # broken meanwhile: the client never reads this one
                    await self._give_back_unread(conn)
            return
        await writer.drain()


def _is_start(req: object) -> bool:
    return (
        isinstance(req, list) and len(req) == 2 and req[0] == "start" and isinstance(req[1], dict)
    )


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
        #: Answers with messages read whole: after a break the TargetList gives back the
        #: rows of any answer it wrote beyond these (``TargetListActor.channel_broke``).
        self.answers_read = 0
        try:
            self._sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_SECONDS)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(frame([secret]))
            if self._read_frame(HEADER_LIMIT) != [True]:
                raise ChannelBroken(f"queue {queue!r}: the delivery channel refused us")
        except (OSError, ValueError) as exc:
            self.close()
            raise ChannelBroken(f"queue {queue!r}: no delivery channel: {exc!r}") from exc

    def start(self, settings: dict, timeout: float) -> object:
        """Start the TargetList (``TargetListActor.start`` by keyword, ``settings``), as
        this connection's first request; returns what it returns. Raises its typed
        error, or ``ChannelBroken`` (the TargetList may have started or not: the caller
        must not use it further) if no answer came within ``timeout`` seconds."""
        with self._lock:
            try:
                self._sock.settimeout(timeout)
                self._sock.sendall(frame(["start", settings]))
                head = self._read_frame(HEADER_LIMIT)
                if isinstance(head, list) and len(head) == 2 and head[0] == "started":
                    return head[1]
                if isinstance(head, list) and len(head) == 3 and head[0] == "error":
                    error = error_of(str(head[1]), str(head[2]))
                else:
                    raise ValueError(f"unexpected answer {head!r:.200}")
            except (OSError, ValueError, IndexError, TypeError, msgpack.UnpackException) as exc:
                self._close_locked()
                raise ChannelBroken(f"queue {self.queue!r}: delivery channel: {exc!r}") from exc
        raise error

    def take(self, max_messages: int, timeout: float) -> pa.RecordBatch | str | None:
        """Up to ``max_messages`` messages, waiting up to ``timeout`` seconds for the
        first: a RecordBatch, None if none came, or ``BY_REFERENCE`` (take them through
        Ray). Raises the queue's typed error, or ``ChannelBroken``."""
        timeout = min(max(timeout, 0.0), MAX_WAIT_SECONDS)
        with self._lock:
            if self._closed:  # checked under the lock: close() shuts the socket first
                raise ChannelBroken(f"queue {self.queue!r}: the delivery channel is closed")
            sent = False
            try:
                self._sock.settimeout(timeout + ANSWER_MARGIN_SECONDS)
                self._sock.sendall(frame([max_messages, timeout]))
                sent = True
                head = self._read_frame(HEADER_LIMIT)
                kind = head[0] if isinstance(head, list) and head else None
                if kind == "batch":
                    got = from_ipc(self._read_exactly(int(head[1])))
                    self.answers_read += 1
                    return got
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
                broken = ChannelBroken(f"queue {self.queue!r}: delivery channel: {exc!r}")
                broken.answer_pending = sent
                raise broken from exc
        raise error

    def close(self) -> None:
        """Close the connection (the server sees the end of it). From another thread
        too: a ``take`` waiting for its answer there ends at once (``ChannelBroken``),
        as the socket is shut down before the lock the take holds is waited for."""
        self._closed = True
        sock = getattr(self, "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # not connected (any more): nothing to wake
                sock.shutdown(socket.SHUT_RDWR)
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
