"""The wire's server: one listening socket per protocol instance, serving its op table.

A ``WireServer`` runs on an actor's event loop. It listens on TCP (the node's address)
and, on Linux, on an abstract Unix socket named after a hash of its secret (a round trip
there costs about half of TCP's over loopback). Every connection must first show the
secret (``HELLO_TIMEOUT_SECONDS``, a header of at most ``frames.HELLO_LIMIT`` bytes,
compared in constant time) and name the protocol and version it speaks; the answer
carries the server's capabilities. Then each request frame ``[id, op, args, sizes]`` is
checked where it enters (the op known, its args by the op's ``check``, its raw buffers
counted) and handed to the op's handler; a bad request gets its own error answer and
takes no other with it. Frames that are not frames drop the connection.

Handlers answer in any order (requests are pipelined). A handler may answer at once,
return an awaitable (run as a task; its result or error is the answer), or keep the
``Request`` and answer later (``DEFERRED``). Answers to one connection written in the
same turn of the event loop leave in one system call.

``close(refusal, grace)`` stops listening; requests from then on get ``refusal``, and
connections close once the tasks under way are answered, at most ``grace`` seconds later.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import logging
import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from raymq.errors import RayMQError
from raymq.wire import frames
from raymq.wire.errors import envelope

log = logging.getLogger("raymq.wire")

#: Seconds a server waits for a new connection's hello before closing it.
HELLO_TIMEOUT_SECONDS = 5.0
#: Longest a closing server waits for the requests under way before it closes their
#: connections (seconds).
CLOSE_GRACE_SECONDS = 10.0
#: The version of the wire (docs/WIRE.md); a client speaking another is refused.
WIRE_VERSION = 1
#: An op's handler returns this when it keeps the request to answer later itself.
DEFERRED = object()
#: Longest a closed connection may take to write what it still holds (seconds).
ABORT_SECONDS = 10.0
#: Answers up to this many bytes in all are joined into one write (bytes).
JOIN_BYTES = 64 * 1024


class Reply(NamedTuple):
    """A handler's answer with raw buffers (a plain return value has none)."""

    value: Any
    buffers: Sequence[frames.Buffer] = ()


@dataclass(frozen=True)
class Op:
    """One request a protocol serves.

    ``handler(request)`` answers it (see the module's docstring). ``check(args,
    buffers)`` raises ``TypeError`` or ``ValueError`` for a malformed request (answered
    with that error; the handler is not called). ``max_buffers``: raw buffers allowed.
    ``cancel_on_eof``: the client ending its side (or vanishing) cancels the handler's
    task, which may still answer (a waiting fetch answers "nothing").
    """

    handler: Callable[[Request], Any]
    check: Callable[[list, list], None] | None = None
    max_buffers: int = 0
    cancel_on_eof: bool = False


@dataclass(frozen=True)
class Protocol:
    """A named op table and its limits: what one kind of server serves."""

    name: str
    ops: Mapping[str, Op]
    #: Longest request header (bytes, after the hello).
    request_limit: int = 64 * 1024
    #: Longest raw buffers of one request, in all (bytes).
    payload_limit: int = 0
    #: Connections served at once; more are closed as they come.
    max_connections: int = 1024
    #: ``on_connection_lost(connection)``: a connection ended (its ``state`` tells what
    #: it carried).
    on_connection_lost: Callable[[Connection], None] | None = None
    #: Shown in the hello's answer (docs/WIRE.md "Capabilities").
    caps: Mapping[str, Any] = field(default_factory=dict)


class Request:
    """One request under way: its op's ``args`` and raw ``buffers``, answered once."""

    __slots__ = ("conn", "id", "op", "args", "buffers", "answered")

    def __init__(self, conn: Connection, req_id: int, op: str, args: list, buffers: list):
        self.conn = conn
        self.id = req_id
        self.op = op
        self.args = args
        self.buffers = buffers
        self.answered = False

    def answer(
        self, value: Any = None, buffers: Sequence[frames.Buffer] = (), *, now: bool = False
    ) -> bool:
        """Answer with ``value`` (msgpack) and raw ``buffers``; False if the connection
        is closing (the client never reads it: its caller gives back what it took).
        ``now``: written at once with what is queued, not at the end of this turn of
        the event loop (ahead of work already waiting to run)."""
        if self.answered:
            return False
        self.answered = True
        written = self.conn.write(frames.encode([self.id, None, value], buffers))
        if now and written:
            self.conn.flush()
        return written

    def fail(self, error: BaseException) -> bool:
        """Answer with ``error`` (its class name and message); False as ``answer``."""
        if self.answered:
            return False
        self.answered = True
        return self.conn.write(frames.encode([self.id, envelope(error), None]))


class Connection(asyncio.BufferedProtocol):
    """One client's connection: frames decoded as they arrive, in the callback that
    received them (no task woken per request)."""

    def __init__(self, server: WireServer):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.authenticated = False
        #: What the protocol keeps per connection (its ops' business).
        self.state: dict[str, Any] = {}
        self._counted = False
        self._hello_timer: asyncio.TimerHandle | None = None
        self._decoder = frames.FrameDecoder(self._frame, frames.HELLO_LIMIT, 0)
        self._out: list[frames.Buffer] = []
        self._tasks: dict[asyncio.Task, bool] = {}  # task -> cancelled by the client's end
        self._ending = False

    # -- asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        if server.connections >= server.protocol.max_connections:
            server.refused_connections += 1
            log.warning(
                "%s: %s refuses a connection: %d open (max_connections)",
                server.what,
                server.protocol.name,
                server.connections,
            )
            transport.close()
            return
        server.connections += 1
        self._counted = True
        if server.closed:
            transport.close()  # accepted just before the listener closed
            return
        server._open.add(self)
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(HELLO_TIMEOUT_SECONDS, transport.close)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            self._decoder.buffer_updated(nbytes)
        except frames.FrameError as exc:  # not a client of ours, or a broken one
            self.server.dropped_connections += 1
            log.info(
                "%s: %s dropped a connection: %s", self.server.what, self.server.protocol.name, exc
            )
            transport.close()
        except Exception:  # a handler's bug: that connection only, never the server
            self.server.dropped_connections += 1
            log.exception("%s: %s connection failed", self.server.what, self.server.protocol.name)
            transport.close()

    def eof_received(self) -> bool:
        """The client ended its side: requests that wait for it are cancelled; the
        connection closes once the others are answered."""
        self._ending = True
        for task, by_eof in list(self._tasks.items()):
            if by_eof:
                task.cancel()
        if not self._tasks:
            self._close_soon()
        return True  # keep our side open for the answers under way

    def connection_lost(self, exc: Exception | None) -> None:
        server = self.server
        if self._counted:
            self._counted = False
            server.connections -= 1
        server._open.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        for task, by_eof in list(self._tasks.items()):
            if by_eof:
                task.cancel()
        self._out.clear()
        if self.authenticated and server.protocol.on_connection_lost is not None:
            try:
                server.protocol.on_connection_lost(self)
            except Exception:
                log.exception(
                    "%s: %s: a connection's end failed", server.what, server.protocol.name
                )

    # -- ours

    @property
    def closing(self) -> bool:
        """True once the connection cannot carry answers any more."""
        return self.transport is None or self.transport.is_closing()

    def write(self, parts: list[frames.Buffer]) -> bool:
        """Queue a frame's parts; every frame queued in this turn of the event loop
        leaves in one write. False if the connection is closing."""
        if self.closing:
            return False
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.extend(parts)
        return True

    def flush(self) -> None:
        """Write what is queued now (``Request.answer(now=True)``)."""
        self._flush()

    def _flush(self) -> None:
        out, self._out = self._out, []
        if not out or self.closing:
            return
        transport = self.transport
        assert transport is not None
        if sum(memoryview(p).nbytes for p in out) <= JOIN_BYTES:
            transport.write(b"".join(out))
        else:
            for part in out:  # no copy of large parts (writelines joins them in 3.11)
                transport.write(part)

    def close(self) -> None:
        """Close the connection now: answers queued are written first, for at most
        ``ABORT_SECONDS`` (a client that reads nothing would keep it, and its place
        among ``max_connections``, for ever)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._flush()
        transport.close()
        with contextlib.suppress(RuntimeError):  # no loop runs: the process is ending
            asyncio.get_running_loop().call_later(ABORT_SECONDS, transport.abort)

    def _close_soon(self) -> None:
        asyncio.get_running_loop().call_soon(self.close)

    def _frame(self, header: list, buffers: list) -> None:
        if not self.authenticated:
            self._hello(header)
            return
        req_id, op_name, args, _sizes = header
        server = self.server
        if op_name == "ping":  # the client tells a busy server from a dead connection
            server.pings_answered += 1
            Request(self, req_id, op_name, [], []).answer(True)
            return
        request = Request(self, req_id, op_name, args, buffers)
        op = server.protocol.ops.get(op_name) if isinstance(op_name, str) else None
        if op is None or type(args) is not list:
            request.fail(ValueError(f"{server.what}: no op {op_name!r:.40} with args {args!r:.40}"))
            return
        if len(buffers) > op.max_buffers:
            request.fail(
                ValueError(f"{server.what}: op {op_name} takes {op.max_buffers} raw buffers")
            )
            return
        if server.refusal is not None:
            request.fail(server.refusal)
            return
        try:
            if op.check is not None:
                op.check(args, buffers)
            got = op.handler(request)
        except Exception as exc:  # typed errors, TypeError, ValueError: its answer
            _log_unexpected(server, op_name, exc)
            request.fail(exc)
            return
        if got is DEFERRED or request.answered:
            return
        if inspect.isawaitable(got):
            self._spawn(request, got, op.cancel_on_eof)
        elif isinstance(got, Reply):
            request.answer(got.value, got.buffers)
        else:
            request.answer(got)

    def _spawn(self, request: Request, awaitable: Any, by_eof: bool) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks[task] = by_eof
        self.server._under_way += 1
        if by_eof and self._ending:
            task.cancel()

        def done(task: asyncio.Task) -> None:
            self._tasks.pop(task, None)
            if task.cancelled():
                pass  # the client ended: nobody reads an answer
            elif (error := task.exception()) is not None:
                _log_unexpected(self.server, request.op, error)
                request.fail(error)
            else:
                got = task.result()
                if isinstance(got, Reply):
                    request.answer(got.value, got.buffers)
                else:
                    request.answer(got)
            self.server._task_done()  # after the answer: a closing server may close now
            if self._ending and not self._tasks:
                self._close_soon()

        task.add_done_callback(done)

    def _hello(self, header: list) -> None:
        """``[0, "hello", [secret, protocol, version], []]``: answered with the caps,
        or the connection is dropped (a stranger learns nothing)."""
        server = self.server
        _id, word, args, _sizes = header
        if not (
            word == "hello"
            and type(args) is list
            and len(args) == 3
            and isinstance(args[0], str)
            and hmac.compare_digest(args[0].encode(), server.secret.encode())
        ):
            raise frames.FrameError("a peer without the secret")
        if args[1] != server.protocol.name or args[2] != WIRE_VERSION:
            raise frames.FrameError(f"a peer speaking {args[1]!r:.40} version {args[2]!r:.10}")
        self.authenticated = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self._decoder.header_limit = server.protocol.request_limit
        self._decoder.payload_limit = server.protocol.payload_limit
        Request(self, 0, "hello", [], []).answer(server.caps())


class WireServer:
    """Serves one ``Protocol`` on TCP (and an abstract Unix socket) from the event loop
    it is started on."""

    def __init__(self, protocol: Protocol, what: str):
        self.protocol = protocol
        self.what = what  # "queue 'orders'", for logs and errors
        self.secret = secrets.token_hex(16)
        self._listeners: list[asyncio.AbstractServer] = []
        self._open: set[Connection] = set()
        self._under_way = 0  # tasks answering requests
        self._running: set[asyncio.Task] = set()
        self.closed = False
        #: Requests from now on are answered with this error (set by ``close``).
        self.refusal: BaseException | None = None
        self.connections = 0
        self.refused_connections = 0  # over max_connections
        self.dropped_connections = 0  # sent what is not a frame, or failed a handler
        self.pings_answered = 0

    def caps(self) -> dict[str, Any]:
        """What the hello's answer tells a client (docs/WIRE.md "Capabilities")."""
        return {
            "protocol": self.protocol.name,
            "version": WIRE_VERSION,
            "ops": sorted(self.protocol.ops),
            "request_limit": self.protocol.request_limit,
            "payload_limit": self.protocol.payload_limit,
            **self.protocol.caps,
        }

    async def start(self, host: str) -> tuple[str, int, str]:
        """Listen on ``host`` (a free port) and the Unix socket; returns (host, port,
        secret), what a client connects with."""
        loop = asyncio.get_running_loop()
        tcp = await loop.create_server(lambda: Connection(self), host, 0)
        self._listeners.append(tcp)
        port = tcp.sockets[0].getsockname()[1]
        address = unix_address(self.protocol.name, self.secret)
        if address is not None:
            try:
                unix = await loop.create_unix_server(lambda: Connection(self), address)
                self._listeners.append(unix)
            except (OSError, NotImplementedError) as exc:  # TCP serves them all the same
                log.info("%s: %s has no Unix socket: %r", self.what, self.protocol.name, exc)
        return host, port, self.secret

    def close(self, refusal: BaseException | None = None, grace: float | None = 0.0) -> None:
        """Stop listening. ``refusal``: the answer to every request from now on.
        ``grace``: seconds to wait for the requests under way before closing the open
        connections (0: now; None: leave them open, they end with the process)."""
        for listener in self._listeners:
            listener.close()
        self._listeners = []
        self.closed = True
        if refusal is not None:
            self.refusal = refusal
        if grace is None:
            return
        if grace <= 0 or not self._under_way:
            self._close_connections()
            return
        with contextlib.suppress(RuntimeError):  # no loop runs: closed at once below
            asyncio.get_running_loop().call_later(grace, self._close_connections)
            return
        self._close_connections()

    def spawn(self, awaitable: Any) -> asyncio.Task:
        """Run ``awaitable`` as a task counted among the work under way (a closing
        server waits for it, up to its grace, before it closes the connections)."""
        task = asyncio.ensure_future(awaitable)
        self._under_way += 1
        self._running.add(task)  # a task not referenced may be collected mid-way
        task.add_done_callback(self._spawned_done)
        return task

    def _spawned_done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._task_done()

    def _task_done(self) -> None:
        self._under_way -= 1
        if self.closed and self.refusal is not None and not self._under_way:
            self._close_connections()  # the last answer under way went: close now

    def _close_connections(self) -> None:
        connections, self._open = self._open, set()
        for conn in connections:
            conn.close()


class ProtocolServer:
    """What each protocol's server shares: its ``WireServer`` (set by the subclass's
    ``__init__``), started and stopped by the actor that owns it."""

    server: WireServer

    @property
    def secret(self) -> str:
        """What a client shows in its hello (handed out by an authenticated Ray call)."""
        return self.server.secret

    @property
    def connections(self) -> int:
        """Connections open now."""
        return self.server.connections

    async def start(self, host: str) -> tuple[str, int, str]:
        """Listen on ``host``; returns (host, port, secret)."""
        return await self.server.start(host)

    def close(self) -> None:
        """Stop listening (open connections end with the actor)."""
        self.server.close(grace=None)


def _log_unexpected(server: WireServer, op: str, error: BaseException) -> None:
    """Log an op's error that is not one of the typed errors clients expect (a bug)."""
    if not isinstance(error, RayMQError | TypeError | ValueError):
        log.error("%s: %s op %s failed", server.what, server.protocol.name, op, exc_info=error)


def unix_address(protocol: str, secret: str) -> str | None:
    """The abstract Unix socket (Linux) a server with ``secret`` also listens on, named
    after a hash of it (names are visible to local users; the secret is not). None
    elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    return f"\0raymq-{protocol}-" + hashlib.sha256(secret.encode()).hexdigest()[:32]
