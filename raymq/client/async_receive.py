"""``AsyncReceives``: a consumer's receives for asyncio code (Ray Serve deployments,
async actors), run in one receive thread per consumer so that a receive waiting for
messages blocks neither the event loop nor a thread of its default pool.

A mixin of ``raymq.client.consumer.Consumer``: it uses the consumer's buffer and its
blocking ``_take`` (which it runs in that thread), and keeps the order of takes: the
rows of a take whose caller was cancelled go back to the front of the buffer before
any later receive slices it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading

import pyarrow as pa

from raymq.batch import EMPTY_DELIVERY
from raymq.client.messages import Message, Messages, _messages
from raymq.errors import ConsumerClosed

_log = logging.getLogger("raymq.client")

#: Longest an async receive waits, in the receive thread, for the one before it to be
#: settled (its caller resumed, or its rows put back): only a loop that stopped with
#: that caller suspended takes this long (seconds).
SETTLE_WAIT_SECONDS = 30.0


class AsyncReceives:
    """``receive_async``, ``receive_batch_async`` and ``async for`` of a consumer."""

    consumer_id: str
    _buffer: pa.RecordBatch | None

    def _init_async_receives(self) -> None:
        """The receive thread's state (none started yet)."""
        #: receive_async's thread: one per consumer, so a receive waiting for messages
        #: holds no thread of the loop's default pool; it runs the takes in order.
        self._receiver: concurrent.futures.ThreadPoolExecutor | None = None
        self._async_takes = 0  # takes under way in that thread (or not settled yet)
        #: Set once the latest async take's rows are settled: handed to its caller, or
        #: back in the buffer (its caller was cancelled). The next take waits for it.
        self._async_settled: threading.Event | None = None

    # The consumer's own (``raymq.client.consumer.Consumer`` defines them).
    def _take(self, max_messages: int, timeout: float | None) -> pa.RecordBatch | None:
        raise NotImplementedError

    def _take_buffered(self, max_messages: int) -> pa.RecordBatch | None:
        raise NotImplementedError

    def _unget(self, rows: pa.RecordBatch) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    async def receive_async(self, max_messages: int = 1, timeout: float | None = None) -> Messages:
        """``receive`` for asyncio code (Ray Serve deployments, async actors): up to
        ``max_messages`` messages, waiting up to ``timeout`` seconds (None: until some
        arrive) without blocking the event loop. Cancelled while waiting, what it took
        meanwhile stays in this consumer's buffer for the next receive (not lost)."""
        batch = await self._take_async(max_messages, timeout)
        return Messages() if batch is None else _messages(batch)

    async def receive_batch_async(
        self, max_messages: int, timeout: float | None = None
    ) -> pa.RecordBatch:
        """``receive_batch`` for asyncio code, as ``receive_async``: up to
        ``max_messages`` as one Arrow RecordBatch, empty if none came within ``timeout``
        seconds."""
        batch = await self._take_async(max_messages, timeout)
        return batch if batch is not None else EMPTY_DELIVERY

    def __aiter__(self) -> AsyncReceives:
        """``async for message in consumer``: messages one at a time as they arrive,
        until the consumer is closed; ack each or they are delivered again."""
        return self

    async def __anext__(self) -> Message:
        while True:
            try:
                got = await self.receive_async(1, None)
            except ConsumerClosed:
                raise StopAsyncIteration from None
            if got:
                return got[0]

    async def _take_async(self, max_messages: int, timeout: float | None) -> pa.RecordBatch | None:
        """``_take`` off the event loop: from the buffer at once when it holds messages
        (slicing it does not block), else in this consumer's receive thread.

        Rows of a take whose caller was cancelled go back to the front of the buffer
        before any later receive slices it: in the receive thread if the cancel came
        first, else on the loop's thread (``_settle``). A later take waits in the receive
        thread until the one before it is settled (its rows handed to its caller or put
        back), and ``_async_takes`` stays raised until then, which keeps later receives
        off the buffer's fast path."""
        if self._buffer is not None and not self._async_takes:
            # Never _take here: emptied by another thread meanwhile, it would fetch on
            # the event loop's thread.
            batch = self._take_buffered(max_messages)
            if batch is not None:
                return batch
        self._check_open()
        if self._receiver is None:
            self._receiver = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"raymq-consumer-{self.consumer_id[:8]}"
            )
        abandoned = threading.Event()
        before, settled = self._async_settled, threading.Event()
        self._async_settled = settled

        def take() -> pa.RecordBatch | None:
            if before is not None and not before.wait(SETTLE_WAIT_SECONDS):
                # Its loop stopped before the earlier take's caller resumed: go on.
                _log.warning("consumer %s: an async receive never settled", self.consumer_id)
            batch = self._take(max_messages, timeout)
            if abandoned.is_set() and batch is not None:
                self._unget(batch)  # its caller was cancelled: the next receive has it
                return None
            return batch

        self._async_takes += 1
        fut = asyncio.get_running_loop().run_in_executor(self._receiver, take)
        try:
            batch = await asyncio.shield(fut)
        except asyncio.CancelledError:
            abandoned.set()
            if fut.done():  # finished before the cancel reached us: its rows come back
                self._settle(settled, fut)
            else:
                fut.add_done_callback(functools.partial(self._settle, settled))
            raise
        except BaseException:
            self._async_takes -= 1
            settled.set()
            raise
        self._async_takes -= 1
        settled.set()
        return batch

    def _settle(self, settled: threading.Event, fut: asyncio.Future) -> None:
        """An abandoned async take finished: its rows (if it kept any) go back to the
        front of the buffer; then later receives may slice the buffer again."""
        try:
            if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
                self._unget(fut.result())
        finally:
            self._async_takes -= 1
            settled.set()
