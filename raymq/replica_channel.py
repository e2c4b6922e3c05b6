"""ReplicaChannel: a leader's commits to a follower over a socket, not a Ray call each.

A replicated commit waits for its followers, so their round trip is on every send's
path. A Ray actor call costs 1-2 ms here and about 0.7 ms of CPU at each end, and a
commit of 2 MiB as a Ray argument goes through the object store and is copied between
nodes (``bench/replication.py`` measured both: 0.22x of an unreplicated queue). So each
follower also listens on a TCP socket on its node's address, and its leader keeps one
connection to it for commits and heartbeats. Catching up (rare, large) stays on Ray.

Security: as the send channel's (``raymq.send_channel``): the server answers only a
client that first presents the follower's secret, which the leader gets through an
(authenticated) Ray call, within ``HELLO_TIMEOUT_SECONDS``.

Frames: a 4-byte big-endian length, then msgpack. The first is ``[secret]``, answered
``[true]``. Then requests, answered in the order they came:

- a commit: ``["apply", epoch, seq, end_offset, ack_length, records, checkpoint,
  deleted]`` where ``records`` is ``[[file name, position, length], ...]`` and
  ``checkpoint`` nil or ``[generation, next offset, length]``, followed by one raw
  buffer: the ack record, the records' bytes and the checkpoint's, in that order
  (``MirrorWrite``, docs/FORMAT.md "Replicas");
- a heartbeat: ``["heartbeat", epoch]``;

answered ``[true]``, or ``["Fenced", epoch]``, ``["Diverged", message]``, or
``[error class name, message]``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import secrets
import struct
from collections.abc import Awaitable

import msgpack

from raymq.storage.mirror import Diverged, MirrorWrite

log = logging.getLogger("raymq.replica_channel")

_LENGTH = struct.Struct(">I")
#: Longest first frame (the secret) a server reads from an unknown peer (bytes).
HELLO_LIMIT = 1024
#: Longest answer (bytes).
ANSWER_LIMIT = 64 * 1024
#: Longest request header (bytes); the raw buffer after it is bounded separately.
HEADER_LIMIT = 16 * 2**20
#: Longest raw buffer of one commit (bytes).
PAYLOAD_LIMIT = 2**31
#: A follower keeps its receive buffer between commits up to this size (bytes).
KEEP_PAYLOAD_BYTES = 64 * 2**20
#: Seconds a client waits to connect and for the server's answer to its secret, in
#: all: less than a commit waits for a follower (``FOLLOWER_TIMEOUT_SECONDS``).
CONNECT_TIMEOUT_SECONDS = 2.0
#: Seconds a server waits for a new connection's secret before closing it.
HELLO_TIMEOUT_SECONDS = 5.0
#: Bytes a connection buffers before it stops reading the socket.
READ_BUFFER_BYTES = 4 * 2**20


class ChannelFailed(ConnectionError):
    """The connection to a follower failed (it is taken out of sync, and caught up)."""


def _frame(obj: object) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return _LENGTH.pack(len(data)) + data


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> object:
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if n > limit:
        raise ValueError(f"frame of {n} bytes over the limit of {limit}")
    return msgpack.unpackb(await reader.readexactly(n), raw=False)


class ReplicaChannelServer:
    """Serves a leader's commits and heartbeats to one follower. ``follower`` has the
    methods of ``raymq.core.replication.ReplicationFollower`` (``apply``,
    ``heartbeat``), whose exceptions are sent back by name. A commit's bytes are
    received straight into one buffer (``asyncio.BufferedProtocol``) and written to
    the files from it: no copy between the socket and the disk."""

    def __init__(self, follower, queue: str):
        self._follower = follower
        self._queue = queue
        self.secret = secrets.token_hex(16)
        self._server: asyncio.AbstractServer | None = None
        self.connections = 0
        self._open: set[_ServerProtocol] = set()

    async def start(self, host: str) -> tuple[str, int, str]:
        """Listen on ``host`` (a free port); returns (host, port, secret)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerProtocol(self), host, 0)
        return host, self._server.sockets[0].getsockname()[1], self.secret

    def close(self) -> None:
        """Stop listening and drop the open connections (a released follower takes no
        more commits)."""
        if self._server is not None:
            self._server.close()
        for protocol in list(self._open):
            protocol.drop()

    def authentic(self, hello: object) -> bool:
        """The first frame presents this follower's secret (compared in constant time)."""
        return (
            isinstance(hello, list)
            and len(hello) == 1
            and isinstance(hello[0], str)
            and hmac.compare_digest(hello[0].encode(), self.secret.encode())
        )

    def handle(self, req: list, payload: memoryview) -> list:
        """Apply one request (its raw buffer ``payload``); returns the answer."""
        if req[0] == "apply":
            return _answer(self._follower.apply, req[1], _mirror_write(req, payload))
        return _answer(self._follower.heartbeat, req[1])


class _ServerProtocol(asyncio.BufferedProtocol):
    """One leader's connection: length, header, then (for a commit) its raw buffer,
    each read into a buffer of its exact size."""

    def __init__(self, server: ReplicaChannelServer):
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._authed = False
        self._stage = "length"
        self._buf = bytearray(_LENGTH.size)
        self._view = memoryview(self._buf)
        self._got = 0
        self._req: list | None = None
        self._payload = bytearray()  # reused: a commit's bytes live only while it applies
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._server.connections += 1
        self._server._open.add(self)
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(HELLO_TIMEOUT_SECONDS, self.drop)

    def connection_lost(self, exc) -> None:
        self._server.connections -= 1
        self._server._open.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()

    def drop(self) -> None:
        """Close the connection."""
        if self._transport is not None:
            self._transport.close()

    def _expect(self, stage: str, n: int, view: memoryview | None = None) -> None:
        self._stage, self._got = stage, 0
        if view is None:
            self._buf = bytearray(n)
            view = memoryview(self._buf)
        self._view = view

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        try:
            while self._got == len(self._view) and not self._transport.is_closing():
                self._advance()
        except Exception as exc:  # nonsense from the peer: drop the connection
            log.warning(
                "queue %r: replica channel dropped a connection: %r", self._server._queue, exc
            )
            self.drop()

    def _advance(self) -> None:
        if self._stage == "length":
            (n,) = _LENGTH.unpack(self._view)
            limit = HEADER_LIMIT if self._authed else HELLO_LIMIT
            if n > limit:
                raise ValueError(f"frame of {n} bytes over the limit of {limit}")
            self._expect("header", n)
        elif self._stage == "header":
            req = msgpack.unpackb(self._view, raw=False)
            if not self._authed:
                if not self._server.authentic(req):
                    raise ValueError("a peer without the secret")
                self._authed = True
                self._hello_timer.cancel()
                self._transport.write(_frame([True]))
                self._expect("length", _LENGTH.size)
            elif isinstance(req, list) and req and req[0] == "apply":
                total = _payload_length(req)
                if len(self._payload) < total:
                    self._payload = bytearray(total)
                self._req = req
                self._expect("payload", total, memoryview(self._payload)[:total])
            elif isinstance(req, list) and len(req) == 2 and req[0] == "heartbeat":
                self._reply(self._server.handle(req, memoryview(b"")))
            else:
                raise ValueError(f"a bad request {req!r:.100}")
        else:  # the commit's raw buffer is in
            req, self._req = self._req, None
            answer = self._server.handle(req, self._view)
            if len(self._payload) > KEEP_PAYLOAD_BYTES:  # not held for ever after a big one
                self._payload = bytearray()
            self._reply(answer)

    def _reply(self, answer: list) -> None:
        self._transport.write(_frame(answer))
        self._expect("length", _LENGTH.size)


def _payload_length(req: list) -> int:
    _, _epoch, _seq, _end, ack_length, records, checkpoint, _deleted = req
    total = ack_length + sum(r[2] for r in records) + (checkpoint[2] if checkpoint else 0)
    if not 0 <= total <= PAYLOAD_LIMIT:
        raise ValueError(f"a commit of {total} bytes")
    return total


def _mirror_write(req: list, payload: memoryview) -> MirrorWrite:
    """The ``MirrorWrite`` a commit request and its raw buffer carry (views into it)."""
    _, epoch, seq, end_offset, ack_length, records, checkpoint, deleted = req
    write = MirrorWrite(epoch=epoch, seq=seq, end_offset=end_offset, deleted=list(deleted))
    pos = 0
    if ack_length:
        write.ack_record, pos = bytes(payload[:ack_length]), ack_length
    for name, at, length in records:
        write.records.append((name, at, [payload[pos : pos + length]]))
        pos += length
    if checkpoint:
        gen, next_offset, length = checkpoint
        write.checkpoint = (gen, next_offset, bytes(payload[pos : pos + length]))
    return write


def _answer(method, *args) -> list:
    # Imported here: raymq.core.replication imports this module.
    from raymq.core.replication import Fenced

    try:
        method(*args)
        return [True]
    except Fenced as exc:
        return ["Fenced", exc.epoch]
    except Diverged as exc:
        return ["Diverged", str(exc)]
    except Exception as exc:  # a disk error, say: the leader takes us out of sync
        return [type(exc).__name__, str(exc)]


class ReplicaChannel:
    """The leader's connection to one follower (asyncio). A request is written to the
    socket as it is made (``apply`` returns an awaitable of the answer), so that it
    travels while the leader writes its own copy; answers come in request order."""

    def __init__(self, host: str, port: int, secret: str, replica: str):
        self._address = (host, port)
        self._secret = secret
        self._replica = replica
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._connecting: asyncio.Future | None = None

    @property
    def connected(self) -> bool:
        """True while the connection is up."""
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self) -> None:
        """Connect and present the secret (``ChannelFailed`` if that fails). Whatever
        ends the attempt (a failure, a timeout, a cancelled caller), the next request
        starts a new one."""
        if self.connected:
            return
        if self._connecting is not None:  # another request is connecting: wait for it
            await asyncio.shield(self._connecting)
            return
        connecting = self._connecting = asyncio.get_running_loop().create_future()
        writer = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
                reader, writer = await asyncio.open_connection(
                    *self._address, limit=READ_BUFFER_BYTES
                )
                writer.write(_frame([self._secret]))
                answer = await _read_frame(reader, ANSWER_LIMIT)
            if answer != [True]:
                raise ChannelFailed(f"replica {self._replica} refused the connection")
        except BaseException as exc:
            if writer is not None:
                writer.close()
            error = (
                exc
                if isinstance(exc, ChannelFailed)
                else ChannelFailed(f"replica {self._replica}: cannot connect: {exc!r}")
            )
            connecting.set_exception(error)
            connecting.exception()  # retrieved: waiters re-raise it themselves
            self._connecting = None
            if isinstance(exc, Exception) and exc is not error:
                raise error from exc
            raise
        self._writer = writer
        self._reader_task = asyncio.get_running_loop().create_task(self._read_answers(reader))
        connecting.set_result(None)
        self._connecting = None

    async def _read_answers(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                answer = await _read_frame(reader, ANSWER_LIMIT)
                if self._waiting:
                    fut = self._waiting.popleft()
                    if not fut.done():
                        fut.set_result(answer)
        except Exception as exc:  # closed, reset, nonsense: every waiting request fails
            self._fail(ChannelFailed(f"replica {self._replica}: connection lost: {exc!r}"))

    def _fail(self, error: Exception) -> None:
        waiting, self._waiting = self._waiting, collections.deque()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error)
                fut.exception()
        self.close()

    def _send(self, header: list, buffers: list) -> Awaitable[None]:
        if not self.connected:
            return self._connect_then_send(header, buffers)
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self._writer.write(_frame(header))
        self._writer.writelines(buffers)
        return self._answered(fut)

    async def _connect_then_send(self, header: list, buffers: list) -> None:
        await self.connect()
        await self._send(header, buffers)

    async def _answered(self, fut: asyncio.Future) -> None:
        try:
            await self._writer.drain()
        except (OSError, AttributeError) as exc:  # AttributeError: closed meanwhile
            self._fail(ChannelFailed(f"replica {self._replica}: {exc!r}"))
        _raise_answer(await fut)

    def apply(self, epoch: int, write: MirrorWrite) -> Awaitable[None]:
        """Send one commit now; the awaitable ends once the follower has it durably."""
        buffers: list = []
        ack_length = 0
        if write.ack_record is not None:
            buffers.append(write.ack_record)
            ack_length = len(write.ack_record)
        records = []
        for name, pos, bufs in write.records:
            records.append([name, pos, sum(memoryview(b).nbytes for b in bufs)])
            buffers += bufs
        checkpoint = None
        if write.checkpoint is not None:
            gen, next_offset, data = write.checkpoint
            checkpoint = [gen, next_offset, len(data)]
            buffers.append(data)
        header = [
            "apply",
            epoch,
            write.seq,
            write.end_offset,
            ack_length,
            records,
            checkpoint,
            write.deleted,
        ]
        return self._send(header, buffers)

    def heartbeat(self, epoch: int) -> Awaitable[None]:
        """Tell the follower the leader of ``epoch`` lives."""
        return self._send(["heartbeat", epoch], [])

    def close(self) -> None:
        """Drop the connection: requests waiting for an answer fail (``ChannelFailed``;
        an answer on a later connection is never taken for theirs), and the next request
        connects again."""
        waiting, self._waiting = self._waiting, collections.deque()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(ChannelFailed(f"replica {self._replica}: channel closed"))
                fut.exception()  # retrieved, if nobody waits any more
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._writer = self._reader_task = None


def _raise_answer(answer: object) -> None:
    if answer == [True]:
        return
    from raymq.core.replication import Fenced

    if isinstance(answer, list) and len(answer) == 2:
        kind, detail = answer
        if kind == "Fenced":
            raise Fenced(int(detail))
        if kind == "Diverged":
            raise Diverged(str(detail))
        raise ChannelFailed(f"{kind}: {detail}")
    raise ChannelFailed(f"a bad answer: {answer!r}")
