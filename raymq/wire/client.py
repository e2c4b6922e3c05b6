"""The wire's client: one connection to a ``WireServer``, requests pipelined over it.

``WireClient`` lives on an asyncio event loop (an actor's, or the process's wire loop
behind ``raymq.wire.blocking``). Each request gets an id and a future; answers come in
any order. While requests wait, a client that heard nothing for ``patience`` seconds
pings the server (a busy server answers pings; a BLOCKed send may wait for ever); a
ping unanswered for ``patience`` more breaks the connection. A request may also carry
its own bound (``within``): past it the connection is taken as broken, as the stream's
state is unknown. Once broken, a client stays broken: every waiting and later request
fails with ``WireBroken``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from raymq.wire import frames
from raymq.wire.errors import WireBroken, error_of
from raymq.wire.server import WIRE_VERSION, unix_address

log = logging.getLogger("raymq.wire")

#: Seconds to connect and to get the hello's answer, in all (a parameter of ``connect``).
CONNECT_TIMEOUT_SECONDS = 5.0
#: A client waiting this long without hearing from its server pings it; a ping
#: unanswered as long again breaks the connection (seconds).
PATIENCE_SECONDS = 30.0
#: Longest answer header a client reads (bytes).
ANSWER_LIMIT = 1 << 20
#: Longest raw buffers of one answer (bytes).
ANSWER_PAYLOAD_LIMIT = 1 << 31

Endpoint = tuple[str, int, str]  # host, port, secret
#: ``done(answer, error)``: a thread's request's outcome, called once on the loop's thread.
Done = Callable[["Answer | None", "BaseException | None"], None]
#: Most buffers one ``sendmsg`` is given (the system's IOV_MAX is 1,024).
_MAX_PARTS = 64
#: SO_LINGER on, 0 seconds: ``close`` resets the connection.
_RESET = struct.pack("ii", 1, 0)


class Answer(NamedTuple):
    """A server's answer: its value, and its raw buffers (none for most ops)."""

    value: Any
    buffers: list


class WireClient:
    """One connection to a server of ``protocol``; see the module's docstring.

    It owns its socket (non-blocking, watched by the loop's reader and writer
    callbacks) rather than an asyncio transport: a request's raw buffers (a producer's
    1 MiB batch) are sent from where they lie with ``sendmsg``, where a transport copies
    what the kernel does not take at once into its own buffer and moves the rest down
    after each send (measured: 0.67 ms of CPU per 1 MiB batch, against 0.1 ms)."""

    def __init__(self, protocol: str, what: str, patience: float):
        self.protocol = protocol
        self.what = what  # "queue 'orders'", for errors and logs
        self.patience = patience
        self.caps: dict[str, Any] = {}
        self.broken: WireBroken | None = None
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._sock: socket.socket | None = None
        self._out: collections.deque[memoryview] = collections.deque()
        self._writer_on = False
        self._eof_after_out = False
        self._decoder = frames.FrameDecoder(self._frame, ANSWER_LIMIT, ANSWER_PAYLOAD_LIMIT)
        self._ids = itertools.count(1)
        #: Guards what threads share: ids, ``_waiting``, ``_out``, ``broken``.
        self._lock = threading.Lock()
        #: request id -> its future (loop's requests) or ``done`` callable (threads').
        self._waiting: dict[int, asyncio.Future | Done] = {}
        self._writer_asked = False  # a thread asked the loop to watch for room
        self._bounds: dict[int, asyncio.TimerHandle] = {}
        self._heard = time.monotonic()
        self._ping_sent: float | None = None
        self._watch: asyncio.TimerHandle | None = None
        self._lost = self._loop.create_future()
        #: The answer's future of the request ``connect`` wrote behind the hello.
        self.first: asyncio.Future | None = None

    @classmethod
    async def connect(
        cls,
        endpoint: Endpoint,
        protocol: str,
        what: str,
        *,
        timeout: float = CONNECT_TIMEOUT_SECONDS,
        patience: float | None = None,
        first: tuple[str, list, float | None] | None = None,
    ) -> WireClient:
        """Connect to ``endpoint`` (its Unix socket when on this machine, else TCP) and
        say hello, within ``timeout`` seconds; ``WireBroken`` if that fails.
        ``patience``: seconds (None: ``PATIENCE_SECONDS``, read now).

        ``first``: an (op, args, within) request written right behind the hello, before
        its answer (the server reads a connection's frames in order: a socket round
        trip saved); its answer's future is ``client.first`` (see ``request``).
        """
        host, port, secret = endpoint
        loop = asyncio.get_running_loop()
        client = cls(protocol, what, PATIENCE_SECONDS if patience is None else patience)
        try:
            async with asyncio.timeout(timeout):
                await client._open(loop, host, port, secret)
                hello = client.request("hello", [secret, protocol, WIRE_VERSION], _id=0)
                if first is not None:
                    op, args, within = first
                    client.first = client.request(op, args, within=within)
                answer = await hello
        except (OSError, TimeoutError, WireBroken, ValueError) as exc:
            client.close()
            raise WireBroken(f"{what}: no {protocol} connection: {exc!r}") from exc
        except BaseException:
            client.close()
            raise
        client.caps = answer.value if isinstance(answer.value, dict) else {}
        return client

    async def _open(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int, secret: str
    ) -> None:
        address = unix_address(self.protocol, secret)
        sock = None
        if address is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, address)
            except OSError:  # another machine (or namespace): TCP
                sock.close()
                sock = None
        if sock is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, (host, port))
            except BaseException:
                sock.close()
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        loop.add_reader(sock.fileno(), self._readable)
        self._watch = loop.call_later(self.patience, self._check)

    # -- requests

    def request(
        self,
        op: str,
        args: list,
        buffers: Sequence[frames.Buffer] = (),
        *,
        within: float | None = None,
        _id: int | None = None,
    ) -> asyncio.Future:
        """Write one request now (on the loop's thread); returns the future of its
        ``Answer`` (or of the server's typed error, or ``WireBroken``). ``within``:
        seconds after which an unanswered request breaks the connection."""
        fut = self._loop.create_future()
        try:
            req_id = self._enqueue(op, args, buffers, fut, _id)
        except WireBroken as exc:
            fut.set_exception(exc)
            return fut
        if within is not None:
            self._bounds[req_id] = self._loop.call_later(within, self._overdue, req_id, within)
        return fut

    def submit(self, op: str, args: list, buffers: Sequence[frames.Buffer], done: Done) -> None:
        """Write one request now, from any thread (the bytes leave from this thread
        when the socket takes them: no hand-off to the loop's); ``done(answer, error)``
        is called once, on the loop's thread. ``WireBroken`` at once (``done`` not
        called) if the connection is broken."""
        self._enqueue(op, args, buffers, done, None)

    def _enqueue(
        self,
        op: str,
        args: list,
        buffers: Sequence[frames.Buffer],
        waiter: asyncio.Future | Done,
        req_id: int | None,
    ) -> int:
        if req_id is None:
            req_id = next(self._ids)  # (atomic: itertools.count is C)
        parts = frames.encode([req_id, op, args], buffers)
        with self._lock:
            if self.broken is not None:
                raise self.broken
            self._waiting[req_id] = waiter
            was_empty = not self._out
            for part in parts:
                view = part if isinstance(part, memoryview) else memoryview(part)
                if view.nbytes:
                    self._out.append(view)
            if was_empty:  # else bytes wait before these: they leave after them
                self._send_locked()
        return req_id

    async def call(
        self,
        op: str,
        args: list,
        buffers: Sequence[frames.Buffer] = (),
        *,
        within: float | None = None,
    ) -> Answer:
        """``request`` and await its answer."""
        return await self.request(op, args, buffers, within=within)

    def half_close(self) -> None:
        """End our side (once what is written left): the server cancels the requests
        that wait on us (a waiting fetch answers "nothing"); answers under way still
        arrive."""
        with self._lock:
            if self._sock is None or self.broken is not None:
                return
            self._eof_after_out = True
            if not self._out:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_WR)

    def close(self, reason: str = "closed") -> None:
        """Close the connection: requests waiting fail with ``WireBroken``."""
        self._break(WireBroken(f"{self.what}: {self.protocol} connection {reason}"))

    async def wait_closed(self) -> None:
        """Until the connection is closed."""
        await asyncio.shield(self._lost)

    # -- liveness

    def _check(self) -> None:
        """Every ``patience`` seconds while connected (threads' requests need no timer
        armed): ping a server not heard from while requests wait, and break a
        connection whose ping went unanswered."""
        self._watch = None
        if self.broken is not None:
            return
        loop = self._loop
        now = time.monotonic()
        quiet = now - self._heard
        if not self._waiting or quiet < self.patience:
            self._watch = loop.call_later(max(self.patience - quiet, 0.01), self._check)
            return
        if self._ping_sent is not None and now - self._ping_sent >= self.patience:
            self._break(WireBroken(f"{self.what}: no answer to a ping in {self.patience} s"))
            return
        if self._ping_sent is None:
            self._ping_sent = now
            ping = self.request("ping", [])
            ping.add_done_callback(self._pong)
        self._watch = loop.call_later(self.patience, self._check)

    def _pong(self, fut: asyncio.Future) -> None:
        self._ping_sent = None
        if not fut.cancelled():
            fut.exception()  # (retrieved: a broken connection tells its waiters itself)

    def _overdue(self, req_id: int, within: float) -> None:
        self._bounds.pop(req_id, None)
        if req_id in self._waiting:
            self._break(WireBroken(f"{self.what}: no answer in {within} s"))

    # -- the socket

    def _send_locked(self) -> None:
        """Send what waits in ``_out`` as far as the socket takes it (any thread, the
        lock held); the rest once the loop sees room."""
        sock, out = self._sock, self._out
        if sock is None:
            return
        try:
            while out:
                sent = sock.sendmsg(list(itertools.islice(out, _MAX_PARTS)))
                while sent:
                    head = out[0]
                    if sent >= head.nbytes:
                        sent -= head.nbytes
                        out.popleft()
                    else:
                        out[0] = head[sent:]
                        sent = 0
        except (BlockingIOError, InterruptedError):
            pass  # the socket is full: the loop sends the rest when it has room
        except OSError as exc:
            out.clear()  # (the break, on the loop's thread, fails every waiter)
            error = WireBroken(f"{self.what}: {self.protocol} connection failed: {exc!r}")
            self._on_loop(self._break, error)
            return
        if out and not self._writer_on and not self._writer_asked:
            self._writer_asked = True
            self._on_loop(self._watch_room)
        elif not out and self._eof_after_out:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)

    def _on_loop(self, callback: Callable, *args: Any) -> None:
        """Run ``callback`` soon on the loop's thread (never now: the caller holds the
        lock, which ``callback`` takes)."""
        if self._loop_thread == threading.get_ident():
            self._loop.call_soon(callback, *args)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback, *args)

    def _watch_room(self) -> None:
        """(The loop's thread) Watch the socket for room while bytes wait."""
        with self._lock:
            self._writer_asked = False
            if self._out and not self._writer_on and self._sock is not None:
                self._loop.add_writer(self._sock.fileno(), self._writable)
                self._writer_on = True

    def _writable(self) -> None:
        """(The loop's thread) The socket has room: send more; stop watching once
        nothing waits."""
        with self._lock:
            self._send_locked()
            if not self._out and self._writer_on and self._sock is not None:
                self._loop.remove_writer(self._sock.fileno())
                self._writer_on = False

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            with self._decoder.get_buffer() as view:
                n = sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._break(WireBroken(f"{self.what}: {self.protocol} connection lost: {exc!r}"))
            return
        if not n:
            self._break(
                WireBroken(f"{self.what}: the server closed the {self.protocol} connection")
            )
            return
        self._heard = time.monotonic()
        try:
            self._decoder.buffer_updated(n)
        except Exception as exc:  # FrameError, or a waiter's callback failing
            self._break(WireBroken(f"{self.what}: {self.protocol} answered nonsense: {exc!r}"))

    def _frame(self, header: list, buffers: list) -> None:
        req_id = header[0]
        with self._lock:
            waiter = self._waiting.pop(req_id, None)
        bound = self._bounds.pop(req_id, None)
        if bound is not None:
            bound.cancel()
        if waiter is None:
            return  # its waiter gave up
        _tell(waiter, *answer_outcome(header, buffers))

    def _break(self, error: WireBroken) -> None:
        """(The loop's thread) Broken for good: every waiter fails, the socket closes."""
        with self._lock:
            if self.broken is None:
                self.broken = error
            waiting, self._waiting = self._waiting, {}
            self._out.clear()
            sock, self._sock = self._sock, None
        for waiter in waiting.values():
            broken = WireBroken(str(self.broken))
            broken.answer_pending = True
            _tell(waiter, None, broken)
        for bound in self._bounds.values():
            bound.cancel()
        self._bounds.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if sock is not None:
            with contextlib.suppress(Exception):  # (a loop closed at the process's exit)
                self._loop.remove_reader(sock.fileno())
                if self._writer_on:
                    self._loop.remove_writer(sock.fileno())
            self._writer_on = False
            if sock.family != socket.AF_UNIX:
                # Reset, not a graceful close: the kernel would otherwise go on trying to
                # hand bytes not yet sent to a peer that reads nothing, and nobody waits
                # for the requests among them any more.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            sock.close()
        if not self._lost.done():
            self._lost.set_result(None)


def answer_outcome(header: list, buffers: list) -> tuple[Answer, None] | tuple[None, BaseException]:
    """An answer frame's outcome: (its ``Answer``, None), or (None, its typed error).
    ``frames.FrameError`` if its error is not ``[name, message]``."""
    _req_id, error, value, _sizes = header
    if error is None:
        return Answer(value, buffers), None
    if type(error) is list and len(error) == 2:
        return None, error_of(str(error[0]), str(error[1]))
    raise frames.FrameError(f"an error that is not [name, message]: {error!r:.80}")


def _tell(
    waiter: asyncio.Future | Done, answer: Answer | None, error: BaseException | None
) -> None:
    """Give a waiter its outcome: a future (unless its awaiter gave up), or a ``done``
    callable (one that fails is logged, never breaking the connection)."""
    if isinstance(waiter, asyncio.Future):
        if waiter.done():
            return
        if error is None:
            waiter.set_result(answer)
        else:
            waiter.set_exception(error)
            waiter.exception()  # retrieved, if its awaiter is gone
        return
    try:
        waiter(answer, error)
    except Exception:
        log.warning("wire: an answer could not be handed over", exc_info=True)
