"""The wire's blocking facade: a ``WireClient`` on this process's wire loop, for threads.

Application threads (a producer's ``send``, a consumer's ``receive``) are not on an
event loop. Each process runs one daemon thread with an asyncio loop for all its wire
connections (``wire_loop``); a ``BlockingClient`` hands its requests to that loop and
waits on a lock, not a ``concurrent.futures.Future`` (whose Condition the woken caller
had to take again from the loop's thread: a second hand-off for every answer).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11
from typing import Any

from raymq.wire import frames
from raymq.wire.client import (
    CONNECT_TIMEOUT_SECONDS,
    Answer,
    Done,
    Endpoint,
    WireClient,
)
from raymq.wire.errors import WireBroken

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0


def wire_loop() -> asyncio.AbstractEventLoop:
    """This process's wire loop, started on first use (again in a forked child)."""
    global _loop, _loop_pid
    with _lock:
        if _loop is None or _loop_pid != os.getpid() or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="raymq-wire", daemon=True)
            thread.start()
            _loop, _loop_pid = loop, os.getpid()
        return _loop


class Waiter:
    """An answer one thread waits for and the wire loop sets once."""

    __slots__ = ("_pending", "_answer", "_error")

    def __init__(self) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()  # released once, by done()
        self._answer: Answer | None = None
        self._error: BaseException | None = None

    def done(self, answer: Answer | None, error: BaseException | None) -> None:
        """Set the outcome (once)."""
        self._answer, self._error = answer, error
        self._pending.release()

    def result(self, timeout: float | None = None) -> Answer:
        """The answer (or its error raised) once set; ``FutureTimeout`` after
        ``timeout`` seconds (None: for ever)."""
        if self._pending.locked():
            if not self._pending.acquire(timeout=-1 if timeout is None else timeout):
                raise FutureTimeout()
            self._pending.release()  # set stays set
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer


class BlockingClient:
    """A ``WireClient`` for threads; all methods may be called from any thread but the
    wire loop's."""

    def __init__(
        self,
        endpoint: Endpoint,
        protocol: str,
        what: str,
        *,
        timeout: float = CONNECT_TIMEOUT_SECONDS,
        patience: float | None = None,
    ):
        self.what = what
        self._loop = wire_loop()
        connect = WireClient.connect(endpoint, protocol, what, timeout=timeout, patience=patience)
        future = asyncio.run_coroutine_threadsafe(connect, self._loop)
        try:
            self._client: WireClient = future.result(timeout + 1.0)
        except FutureTimeout as exc:
            future.cancel()
            raise WireBroken(f"{what}: no {protocol} connection in {timeout} s") from exc

    @property
    def broken(self) -> WireBroken | None:
        """Why the connection broke (None while it works)."""
        return self._client.broken

    def rename(self, what: str) -> None:
        """Name the connection ``what`` in errors and logs from now on."""
        self.what = self._client.what = what

    @property
    def caps(self) -> dict[str, Any]:
        """The server's capabilities, from its hello."""
        return self._client.caps

    def submit(
        self,
        op: str,
        args: list,
        buffers: Sequence[frames.Buffer] = (),
        done: Done | None = None,
    ) -> Waiter | None:
        """Send a request without waiting (from this thread: no hand-off to the wire
        loop's). ``done(answer, error)`` is called once, on the wire loop's thread
        (None: a ``Waiter`` is returned). ``WireBroken`` at once if the connection is
        known broken (``done`` is then not called)."""
        waiter = None
        if done is None:
            waiter = Waiter()
            done = waiter.done
        self._client.submit(op, args, buffers, done)
        return waiter

    def call(
        self,
        op: str,
        args: list,
        buffers: Sequence[frames.Buffer] = (),
        *,
        within: float | None = None,
    ) -> Answer:
        """Send a request and wait for its answer (raises its typed error, or
        ``WireBroken``); the client's pings bound the wait on a silent server, and
        ``within`` (seconds) this request's: past it the connection is broken."""
        waiter = self.submit(op, args, buffers)
        assert waiter is not None
        try:
            return waiter.result(timeout=within)
        except FutureTimeout:
            self.close()
            broken = WireBroken(f"{self.what}: no answer in {within} s")
            broken.answer_pending = True
            raise broken from None

    async def call_async(
        self,
        op: str,
        args: list,
        buffers: Sequence[frames.Buffer] = (),
    ) -> Answer:
        """``call`` for code on another event loop: awaits without blocking it."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(answer: Answer | None, error: BaseException | None) -> None:
            if not loop.is_closed():  # its awaiter went with its loop: nobody to tell
                loop.call_soon_threadsafe(_resolve, fut, answer, error)

        self.submit(op, args, buffers, done)
        return await fut

    def close(self) -> None:
        """Close the connection; waiting requests fail with ``WireBroken`` (from any
        thread: a request waiting in another thread ends at once)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._client.close)


def _resolve(fut: asyncio.Future, answer: Answer | None, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(answer)
