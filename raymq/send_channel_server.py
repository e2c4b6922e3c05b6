"""SendChannelServer: the queue actor's side of the SendChannel (``raymq.send_channel``
says what travels on it and why): it authenticates each connection, parses requests
in the event loop's callback, gathers the ones that arrive together into one
``MessageBatch`` (one record on disk, one group commit) and answers each.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import Callable, Iterable

import msgpack

from raymq import errors, send_channel
from raymq.batch import MessageBatch
from raymq.properties import check_encoded_properties
from raymq.send_channel import _LENGTH, FRAME_OVERHEAD, SendBatch, frame

log = logging.getLogger("raymq.send_channel")

#: Longest first frame (the secret) a server reads from an unknown peer (bytes).
HELLO_LIMIT = 1024
#: Seconds a server waits for a new connection's secret before closing it.
HELLO_TIMEOUT_SECONDS = 5.0
#: Connections a queue actor serves at once; more are closed at once (connections).
MAX_CONNECTIONS = 256
#: After ``SendChannelServer.close``, open connections are closed once the stores under
#: way are answered, or after this long at most (seconds): a client still waiting then
#: gets ``ChannelBroken`` and sends again.
CLOSE_GRACE_SECONDS = 5.0


class SendChannelServer:
    """Serves single sends for one queue: ``send_batch(batch, timeout)`` stores a batch
    and returns (first offset, count stored), as ``QueueCore.send_batch`` does.

    ``gather`` False: each single send is stored as a batch of its own, never with
    other clients' sends (a queue whose ``address_full_policy`` FAIL or BLOCK judges a
    batch whole must not refuse a send that fits because another shared its batch; the
    queue's group commit still writes them together)."""

    def __init__(
        self, send_batch: SendBatch, queue: str, max_message_size: int, *, gather: bool = True
    ):
        self._send_batch = send_batch
        self._gathers = gather
        self._queue = queue
        self._max_message_size = max_message_size
        self._frame_limit = max_message_size + FRAME_OVERHEAD
        self._where = f"a message for queue {queue!r}"
        self.secret = secrets.token_hex(16)
        self._server: asyncio.AbstractServer | None = None
        self._unix: asyncio.AbstractServer | None = None
        # Requests gathered since the last flush: (body, properties, timeout, id, transport).
        self._gathered: list[tuple[bytes, bytes, float | None, int, asyncio.Transport]] = []
        self._tasks: set[asyncio.Task] = set()
        self._open: set[asyncio.Transport] = set()  # authenticated or not
        self._closed = False
        self._refusal = f"queue {queue!r} is not served here any more: ask the broker again"
        self.connections = 0
        self.refused_connections = 0
        self.pings_answered = 0

    async def start(self, host: str) -> tuple[str, int, str]:
        """Listen on ``host`` (a free port), and on Linux on an abstract Unix socket
        named after the secret (``unix_address``) for clients on the same machine;
        returns (host, port, secret)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, 0)
        port = self._server.sockets[0].getsockname()[1]
        address = send_channel.unix_address(self.secret)  # (patched in tests)
        if address is not None:
            try:
                self._unix = await loop.create_unix_server(lambda: _Connection(self), address)
            except (OSError, NotImplementedError) as exc:  # TCP serves them all the same
                log.info("queue %r: no Unix send channel: %r", self._queue, exc)
        return host, port, self.secret

    def close(self) -> None:
        """Stop serving (the queue hibernates or stops): stop listening, answer every
        request from now on ``NotLeader`` (its client sends it through Ray, which finds
        the queue's next actor), and close the open connections once the stores under
        way are answered (they end as the queue flushes its pending sends), at most
        ``CLOSE_GRACE_SECONDS`` later. Call it on the event loop's thread."""
        for server in (self._server, self._unix):
            if server is not None:
                server.close()
        if self._closed:
            return
        self._closed = True
        if self._gathered:  # not handed to the queue yet: refused, never half stored
            gathered, self._gathered = self._gathered, []
            self._refuse(gathered)
        if not self._tasks:
            self._close_connections()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop runs: nothing can answer the stores either
            self._close_connections()
            return
        loop.call_later(CLOSE_GRACE_SECONDS, self._close_connections)

    def _close_connections(self) -> None:
        """End every open connection: its client's waiting requests get ChannelBroken."""
        transports, self._open = self._open, set()
        for transport in transports:
            transport.close()

    def _refuse(self, items: list) -> None:
        error = errors.NotLeader(self._refusal)
        _write_replies(
            (transport, [req_id, None, "NotLeader", str(error)]) for *_, req_id, transport in items
        )

    def _authentic(self, hello: object) -> bool:
        """True if ``hello`` is ``[secret]`` (compared in constant time)."""
        return (
            isinstance(hello, list)
            and len(hello) == 1
            and isinstance(hello[0], str)
            and hmac.compare_digest(hello[0].encode(), self.secret.encode())
        )

    def _request(self, req: object, transport: asyncio.Transport) -> list[int] | None:
        """Handle one request frame; returns the lengths of the raw buffers that follow
        a batch request (None: none follow). ``ValueError`` drops the connection."""
        if type(req) is not list or not req or not _is_id(req[0]):
            raise ValueError("a request without an id")  # nothing to answer
        n = len(req)
        if n == 4:  # one message: the hot path, first
            self._gather(req, transport)
        elif n == 1:
            _replier(req[0], transport)(True)
            self.pings_answered += 1
        elif n == 3:
            return self._batch_lengths(req)
        else:
            _replier(req[0], transport)(None, ValueError(f"bad request to {self._queue!r}"))
        return None

    def _batch_lengths(self, req: list) -> list[int]:
        """The byte lengths of a batch request's four buffers (``ValueError``, which
        drops the connection, if they or its timeout are malformed: its buffers follow)."""
        _req_id, timeout, lengths = req
        if not _is_timeout(timeout):
            raise ValueError(f"bad timeout {timeout!r}")
        if (
            not isinstance(lengths, list)
            or len(lengths) != 4
            or not all(isinstance(n, int) and n >= 0 for n in lengths)
            or sum(lengths) > self._frame_limit
        ):
            raise ValueError(f"bad batch request {lengths!r}")
        return lengths

    def _batch(self, req: list, buffers: list[bytes], transport: asyncio.Transport) -> None:
        """Store a batch request whose buffers arrived (in a task: the next request is
        read meanwhile, and concurrent batches share the queue's group commit)."""
        req_id, timeout, _lengths = req
        reply = _replier(req_id, transport)
        if self._closed:
            reply(None, errors.NotLeader(self._refusal))
            return
        if self._gathered:  # single sends received before it are stored before it
            self._flush()
        try:
            batch = MessageBatch.from_wire(buffers, self._queue)
        except ValueError as exc:
            reply(None, exc)
            return

        async def store() -> None:
            try:
                first, count = await self._send_batch(batch, timeout)
            except Exception as exc:
                reply(None, exc)
                return
            reply([first, count])

        self._spawn(store())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a task not referenced may be collected mid-way
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if self._closed and not self._tasks:  # the last store answered: close now
            self._close_connections()

    def _gather(self, req: list, transport: asyncio.Transport) -> None:
        """Check one message where it enters, alone (a bad one gets its error and takes
        no other request of the gather with it), and gather it for the next flush."""
        req_id, body, props, timeout = req
        if not isinstance(body, bytes) or not isinstance(props, bytes):
            error: Exception = TypeError(
                f"send to queue {self._queue!r}: body and properties as bytes"
            )
        elif timeout is not None and not _is_timeout(timeout):
            error = TypeError(f"send to queue {self._queue!r}: timeout {timeout!r}")
        elif len(body) + len(props) > self._max_message_size:
            # The queue counts properties toward max_message_size; checked here, not
            # in the gathered batch, where it would fail every message of the gather.
            error = errors.MessageTooLarge(
                f"message 0 for queue {self._queue!r} is {len(body) + len(props)} bytes;"
                f" max_message_size is {self._max_message_size}"
            )
        elif self._closed:
            error = errors.NotLeader(self._refusal)
        else:
            if props:  # b"": no properties, nothing to decode
                try:
                    check_encoded_properties(props, where=self._where)
                except errors.InvalidProperties as exc:
                    _replier(req_id, transport)(None, exc)
                    return
            if not self._gathered:
                # After every request already received is read (they are parsed in
                # the same callback): those arriving together share one commit.
                asyncio.get_running_loop().call_soon(self._flush)
            self._gathered.append((body, props, timeout, req_id, transport))
            return
        _replier(req_id, transport)(None, error)

    def _flush(self) -> None:
        gathered, self._gathered = self._gathered, []
        if not gathered:  # refused by close() meanwhile
            return
        if not self._gathers:
            for item in gathered:  # in the order received: the queue keeps it
                self._spawn(self._store([item], item[2]))
            return
        timeout = gathered[0][2]
        if all(item[2] == timeout for item in gathered):  # the usual case: one group
            self._spawn(self._store(gathered, timeout))
            return
        # One timeout per stored batch: runs of equal timeouts, in the order received
        # (the queue stores the tasks' batches in the order they start).
        run = [gathered[0]]
        for item in gathered[1:]:
            if item[2] != run[0][2]:
                self._spawn(self._store(run, run[0][2]))
                run = []
            run.append(item)
        self._spawn(self._store(run, run[0][2]))

    async def _store(self, items: list, timeout: float | None) -> None:
        try:
            batch = MessageBatch.from_encoded([i[0] for i in items], [i[1] for i in items])
            first, count = await self._send_batch(batch, timeout)
        except Exception as exc:  # every request of the batch gets the error
            error = [type(exc).__name__, str(exc)]
            _write_replies((writer, [req_id, None, *error]) for *_, req_id, writer in items)
            return
        offsets = [first + k if k < count else None for k in range(len(items))]  # None: DROPped
        _write_replies(
            (writer, [req_id, offset, None, None])
            for offset, (*_, req_id, writer) in zip(offsets, items, strict=True)
        )


class _Connection(asyncio.Protocol):
    """One client's connection: frames parsed straight from the bytes received, as many
    as arrived, in the callback that received them (no task woken per request, as a
    stream reader's would be)."""

    def __init__(self, server: SendChannelServer):
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._authenticated = False
        self._counted = False
        self._hello_timer: asyncio.TimerHandle | None = None
        #: A batch request whose raw buffers are awaited, and their lengths.
        self._batch: tuple[list, list[int]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        server = self._server
        if server.connections >= MAX_CONNECTIONS:
            server.refused_connections += 1
            log.warning(
                "queue %r: send channel refuses a connection: %d open (MAX_CONNECTIONS)",
                server._queue,
                server.connections,
            )
            transport.close()
            return
        server.connections += 1
        self._counted = True
        if server._closed:
            transport.close()  # accepted just before the listener closed
            return
        server._open.add(transport)  # type: ignore[arg-type]
        # A connection silent for that long is not a client of this queue.
        self._hello_timer = asyncio.get_running_loop().call_later(
            HELLO_TIMEOUT_SECONDS, transport.close
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self._counted = False
            self._server.connections -= 1
        self._server._open.discard(self._transport)  # type: ignore[arg-type]
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        buf = self._buffer
        buf += data
        try:
            used = self._parse(buf, transport)
        except ValueError:  # nonsense, a frame over the limit, a stranger: drop it
            transport.close()
            return
        except Exception as exc:  # msgpack's own errors among them: never kill the server
            log.warning("queue %r: send channel dropped a connection: %r", self._server._queue, exc)
            transport.close()
            return
        if used:
            del buf[:used]

    def _parse(self, buf: bytearray, transport: asyncio.Transport) -> int:
        """Handle every complete frame in ``buf``; returns the bytes they took."""
        server, pos, end = self._server, 0, len(buf)
        while True:
            if self._batch is not None:  # a batch's raw buffers follow its header
                req, lengths = self._batch
                need = sum(lengths)
                if end - pos < need:
                    return pos
                buffers = []
                with memoryview(buf) as view:  # released before ``buf`` is cut
                    for n in lengths:
                        buffers.append(view[pos : pos + n].tobytes())
                        pos += n
                self._batch = None
                server._batch(req, buffers, transport)
                continue
            if end - pos < _LENGTH.size:
                return pos
            (n,) = _LENGTH.unpack_from(buf, pos)
            limit = server._frame_limit if self._authenticated else HELLO_LIMIT
            if n > limit:
                raise ValueError(f"frame of {n} bytes over the limit of {limit}")
            if end - pos - _LENGTH.size < n:
                return pos
            start = pos + _LENGTH.size
            obj = msgpack.unpackb(buf[start : start + n], raw=False)
            pos = start + n
            if not self._authenticated:
                if not server._authentic(obj):
                    raise ValueError("not a client of this queue")
                self._authenticated = True
                if self._hello_timer is not None:
                    self._hello_timer.cancel()
                    self._hello_timer = None
                transport.write(frame([True]))
                continue
            lengths = server._request(obj, transport)
            if lengths is not None:
                self._batch = (obj, lengths)


def _write_replies(replies: Iterable[tuple[asyncio.Transport, list]]) -> None:
    """Write each (transport, answer) as a frame, the answers to one connection in one
    write: one system call for a whole group commit's senders, not one each."""
    out: dict[asyncio.Transport, list[bytes]] = {}
    for writer, answer in replies:
        frames = out.get(writer)
        if frames is None:
            frames = out[writer] = []
        frames.append(frame(answer))
    for writer, frames in out.items():
        if not writer.is_closing():
            writer.write(frames[0] if len(frames) == 1 else b"".join(frames))


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_timeout(value: object) -> bool:
    """None or a number of seconds >= 0 (not a bool)."""
    if value is None:
        return True
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _replier(req_id: int, writer: asyncio.Transport) -> Callable:
    """``reply(result, error=None)`` answering request ``req_id`` on ``writer``."""

    def reply(result: object, error: Exception | None = None) -> None:
        if writer.is_closing():
            return
        if error is None:
            writer.write(frame([req_id, result, None, None]))
        else:
            writer.write(frame([req_id, None, type(error).__name__, str(error)]))

    return reply
