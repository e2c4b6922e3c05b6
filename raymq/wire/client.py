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
import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Sequence
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


class Answer(NamedTuple):
    """A server's answer: its value, and its raw buffers (none for most ops)."""

    value: Any
    buffers: list


class WireClient(asyncio.BufferedProtocol):
    """One connection to a server of ``protocol``; see the module's docstring."""

    def __init__(self, protocol: str, what: str, patience: float):
        self.protocol = protocol
        self.what = what  # "queue 'orders'", for errors and logs
        self.patience = patience
        self.caps: dict[str, Any] = {}
        self.broken: WireBroken | None = None
        self.requests_written = 0
        self._transport: asyncio.Transport | None = None
        self._decoder = frames.FrameDecoder(self._frame, ANSWER_LIMIT, ANSWER_PAYLOAD_LIMIT)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._bounds: dict[int, asyncio.TimerHandle] = {}
        self._heard = time.monotonic()
        self._ping_sent: float | None = None
        self._watch: asyncio.TimerHandle | None = None
        self._lost = asyncio.get_running_loop().create_future()

    @classmethod
    async def connect(
        cls,
        endpoint: Endpoint,
        protocol: str,
        what: str,
        *,
        timeout: float = CONNECT_TIMEOUT_SECONDS,
        patience: float = PATIENCE_SECONDS,
    ) -> WireClient:
        """Connect to ``endpoint`` (its Unix socket when on this machine, else TCP) and
        say hello, within ``timeout`` seconds; ``WireBroken`` if that fails."""
        host, port, secret = endpoint
        loop = asyncio.get_running_loop()
        client = cls(protocol, what, patience)
        try:
            async with asyncio.timeout(timeout):
                await client._open(loop, host, port, secret)
                answer = await client.request("hello", [secret, protocol, WIRE_VERSION], _id=0)
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
        if address is not None:
            with contextlib.suppress(OSError):  # another machine (or namespace): TCP
                await loop.create_unix_connection(lambda: self, address)
                return
        await loop.create_connection(lambda: self, host, port)
        sock = self._transport.get_extra_info("socket") if self._transport else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

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
        """Write one request now; returns the future of its ``Answer`` (or of the
        server's typed error, or ``WireBroken``). ``within``: seconds after which an
        unanswered request breaks the connection."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self.broken is not None:
            fut.set_exception(self.broken)
            return fut
        req_id = next(self._ids) if _id is None else _id
        self._waiting[req_id] = fut
        parts = frames.encode([req_id, op, args], buffers)
        transport = self._transport
        assert transport is not None
        if len(parts) == 1:
            transport.write(parts[0])
        else:
            for part in parts:
                transport.write(part)
        self.requests_written += 1
        if within is not None:
            self._bounds[req_id] = loop.call_later(within, self._overdue, req_id, within)
        if self._watch is None:
            self._watch = loop.call_later(self.patience, self._check)
        return fut

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
        """End our side: the server cancels the requests that wait on us (a waiting
        fetch answers "nothing"); answers under way still arrive."""
        if self._transport is not None and self.broken is None:
            with contextlib.suppress(OSError, RuntimeError):
                self._transport.write_eof()

    def close(self, reason: str = "closed") -> None:
        """Close the connection: requests waiting fail with ``WireBroken``."""
        self._break(WireBroken(f"{self.what}: {self.protocol} connection {reason}"))

    async def wait_closed(self) -> None:
        """Until the connection is closed."""
        await asyncio.shield(self._lost)

    # -- liveness

    def _check(self) -> None:
        """Every ``patience`` seconds while requests wait: ping a server not heard
        from, and break a connection whose ping went unanswered."""
        self._watch = None
        if self.broken is not None or not self._waiting:
            return
        now = time.monotonic()
        quiet = now - self._heard
        loop = asyncio.get_running_loop()
        if quiet < self.patience:
            self._watch = loop.call_later(self.patience - quiet, self._check)
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

    # -- asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._heard = time.monotonic()
        try:
            self._decoder.buffer_updated(nbytes)
        except Exception as exc:  # FrameError, or a waiter's callback failing
            self._break(WireBroken(f"{self.what}: {self.protocol} answered nonsense: {exc!r}"))

    def eof_received(self) -> bool:
        self._break(WireBroken(f"{self.what}: the server closed the {self.protocol} connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._break(WireBroken(f"{self.what}: {self.protocol} connection lost: {exc!r}"))
        if not self._lost.done():
            self._lost.set_result(None)

    def _frame(self, header: list, buffers: list) -> None:
        req_id, error, value, _sizes = header
        fut = self._waiting.pop(req_id, None)
        bound = self._bounds.pop(req_id, None)
        if bound is not None:
            bound.cancel()
        if fut is None or fut.done():
            return  # its waiter gave up (cancelled)
        if error is None:
            fut.set_result(Answer(value, buffers))
        elif type(error) is list and len(error) == 2:
            fut.set_exception(error_of(str(error[0]), str(error[1])))
        else:
            raise frames.FrameError(f"an error that is not [name, message]: {error!r:.80}")

    def _break(self, error: WireBroken) -> None:
        if self.broken is None:
            self.broken = error
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                broken = WireBroken(str(self.broken))
                broken.answer_pending = True
                fut.set_exception(broken)
                fut.exception()  # retrieved, if its waiter is gone
        for bound in self._bounds.values():
            bound.cancel()
        self._bounds.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._transport is not None:
            # abort, not close: close waits for the bytes not yet sent to leave, which a
            # peer that reads nothing never takes (the socket would stay for ever), and
            # nobody waits for the requests among them any more.
            self._transport.abort()
