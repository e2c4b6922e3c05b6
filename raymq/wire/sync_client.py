"""SyncClient: a connection read by the thread that waits on it, not by the wire loop.

``BlockingClient`` hands a thread's request to the process's wire loop, whose thread
reads the answer and wakes the caller: two wake-ups and a hand-over of the GIL for each
answer, and the caller's answer waits behind whatever else that loop is doing (in an
application, its producers' answers). For a protocol whose client has one request at a
time and one thread waiting on it (a consumer's ``take``, ``raymq.wire.delivery``), the
caller reading its own socket wakes once. Measured at 1,000 msg/s on 2 cores (8 s runs,
three alternated pairs): the TargetList -> consumer hop 0.36 -> 0.29 ms at p50 and
1.46 -> 1.06 ms at p99, send -> receive p99 7.70 -> 7.10 ms.

The frames, the hello and the pings are the wire's (docs/WIRE.md): while a request
waits, a server not heard from for ``patience`` seconds is pinged, and one still silent
``patience`` seconds after that breaks the connection. Once broken (a failure, a bound
passed, ``close``), the client stays broken: every call raises ``WireBroken``.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from raymq.wire import frames
from raymq.wire.client import (
    ANSWER_LIMIT,
    ANSWER_PAYLOAD_LIMIT,
    CONNECT_TIMEOUT_SECONDS,
    PATIENCE_SECONDS,
    Answer,
    Endpoint,
    answer_outcome,
)
from raymq.wire.errors import WireBroken
from raymq.wire.server import WIRE_VERSION, unix_address

#: The hello's request id (as ``WireClient``'s).
_HELLO_ID = 0


class SyncClient:
    """One connection to a server of ``protocol`` at ``endpoint`` (its Unix socket when
    on this machine, else TCP), opened with its hello within ``timeout`` seconds
    (``WireBroken`` if not). ``call`` is for one thread at a time; ``close`` for any
    thread (a call waiting in another ends at once)."""

    def __init__(
        self,
        endpoint: Endpoint,
        protocol: str,
        what: str,
        *,
        timeout: float = CONNECT_TIMEOUT_SECONDS,
        patience: float | None = None,
    ):
        self.protocol = protocol
        self.what = what  # "queue 'orders'", for errors
        self.patience = PATIENCE_SECONDS if patience is None else patience
        self.caps: dict[str, Any] = {}
        self.broken: WireBroken | None = None
        self._ids = itertools.count(_HELLO_ID + 1)
        self._frames: list[tuple[list, list]] = []
        self._decoder = frames.FrameDecoder(
            lambda header, buffers: self._frames.append((header, buffers)),
            ANSWER_LIMIT,
            ANSWER_PAYLOAD_LIMIT,
        )
        #: Guards ``_sock`` and ``_calling`` between ``call`` and ``close``.
        self._lock = threading.Lock()
        self._calling = False
        host, port, secret = endpoint
        try:
            self._sock = _connect(protocol, host, port, secret, timeout)
        except OSError as exc:
            raise WireBroken(f"{what}: no {protocol} connection: {exc!r}") from exc
        try:
            hello = self.call("hello", [secret, protocol, WIRE_VERSION], within=timeout)
        except Exception as exc:
            self.close()
            raise WireBroken(f"{what}: no {protocol} connection: {exc!r}") from exc
        self.caps = hello.value if isinstance(hello.value, dict) else {}

    def rename(self, what: str) -> None:
        """Name the connection ``what`` in errors from now on."""
        self.what = what

    def call(
        self,
        op: str,
        args: list,
        buffers: Sequence[frames.Buffer] = (),
        *,
        within: float | None = None,
    ) -> Answer:
        """Send a request and read its answer (raises its typed error, or
        ``WireBroken`` with ``answer_pending`` set); ``within`` (seconds) bounds this
        request: past it the connection is broken."""
        with self._lock:
            if self.broken is not None:
                raise WireBroken(str(self.broken))
            self._calling = True
        req_id = _HELLO_ID if op == "hello" else next(self._ids)
        try:
            self._send(frames.encode([req_id, op, args], buffers))
            answer, error = self._answer(req_id, within)
        except WireBroken as exc:
            raise self._break(str(exc)) from None
        except OSError as exc:
            raise self._break(f"{self.what}: {self.protocol} connection lost: {exc!r}") from exc
        except frames.FrameError as exc:
            raise self._break(f"{self.what}: {self.protocol} answered nonsense: {exc!r}") from exc
        finally:
            with self._lock:
                self._calling = False
                if self.broken is not None:
                    self._sock.close()  # (here, not in close: this thread was reading it)
        if error is not None:  # the server's typed error (some are OSErrors: not above)
            raise error
        return answer

    def close(self) -> None:
        """Close the connection (from any thread): a call waiting in another thread ends
        at once with ``WireBroken``."""
        with self._lock:
            if self.broken is None:
                self.broken = WireBroken(f"{self.what}: the {self.protocol} connection was closed")
            with contextlib.suppress(OSError):  # (not connected any more)
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread reading it
            if not self._calling:
                self._sock.close()

    def _send(self, parts: list[frames.Buffer]) -> None:
        # Small requests, one at a time: the socket's buffer never fills unless the
        # server is gone (then ``patience`` bounds the wait).
        self._sock.settimeout(self.patience)
        self._sock.sendall(b"".join(parts))  # (one copy, one system call)

    def _answer(
        self, req_id: int, within: float | None
    ) -> tuple[Answer, None] | tuple[None, BaseException]:
        """Read frames until request ``req_id``'s outcome (``answer_outcome``'s);
        pings a silent server."""
        start = heard = time.monotonic()
        ping_sent: float | None = None
        while True:
            for header, buffers in self._take_frames():
                if header[0] == req_id:
                    return answer_outcome(header, buffers)
                ping_sent = None  # (a ping's answer, or a stale one: the server is alive)
            now = time.monotonic()
            if within is not None and now - start >= within:
                raise WireBroken(f"{self.what}: no answer in {within} s")
            if ping_sent is not None and now - ping_sent >= self.patience:
                raise WireBroken(f"{self.what}: no answer to a ping in {self.patience} s")
            if ping_sent is None and now - heard >= self.patience:
                ping_sent = now
                self._send(frames.encode([next(self._ids), "ping", []]))
            wait = self.patience - (now - (heard if ping_sent is None else ping_sent))
            if within is not None:
                wait = min(wait, within - (now - start))
            if self._receive(max(wait, 0.001)):
                heard = time.monotonic()

    def _receive(self, timeout: float) -> bool:
        """Receive what comes within ``timeout`` seconds into the decoder; False if
        nothing came. Raises ``WireBroken`` at the end of the stream."""
        sock = self._sock
        sock.settimeout(timeout)
        try:
            with self._decoder.get_buffer() as view:
                n = sock.recv_into(view)
        except TimeoutError:
            return False
        if not n:
            raise WireBroken(
                str(self.broken) if self.broken is not None
                else f"{self.what}: the server closed the {self.protocol} connection"
            )  # fmt: skip
        self._decoder.buffer_updated(n)
        return True

    def _take_frames(self) -> list[tuple[list, list]]:
        got, self._frames = self._frames, []
        return got

    def _break(self, message: str) -> WireBroken:
        """Broken for good (the socket is closed by ``call`` on its way out)."""
        with self._lock:
            if self.broken is None:
                self.broken = WireBroken(message)
            message = str(self.broken)
        broken = WireBroken(message)
        broken.answer_pending = True
        return broken


def _connect(protocol: str, host: str, port: int, secret: str, timeout: float) -> socket.socket:
    """A blocking socket to the server: its abstract Unix socket if it listens on one
    here, else TCP (no Nagle delay)."""
    address = unix_address(protocol, secret)
    if address is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
            return sock
        except OSError:  # another machine (or namespace): TCP
            sock.close()
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


__all__ = ["SyncClient"]
