"""The send protocol: producers' sends to a queue actor over the wire, not a Ray call each.

A Ray actor call costs 1-2 ms of round trip here (docs/ARCHITECTURE.md). A producer that
sends one message at a time and waits for each is bound by that round trip, however
well the actor's group commit shares fsyncs; and a batch as a Ray argument goes through
the object store (~6 ms of the producer's CPU per 1 MiB batch here, measured). So a
queue actor serves this protocol (docs/WIRE.md "send"), and each client process keeps
one connection per queue (``raymq.client.handles``), many sends in flight at once.

Ops:

- ``send [body, properties, timeout]``: one message (properties msgpack-encoded as in a
  ``MessageBatch``; timeout seconds or nil), answered with its offset once durable (nil:
  DROPped). One whose properties carry a producer id (``_AMQ_DUPL_ID``) is not stored
  again within the queue's ``dedup_window_s``: answered with the first one's offset.
  Single sends that arrive together are gathered into one ``MessageBatch`` (one record
  on disk, one group commit), as a client's producer gathers its threads'.
- ``send_batch [timeout]`` with four raw buffers (``MessageBatch.wire_buffers``),
  answered ``[first offset, count stored]``.
- ``ack [consumer_id, subscription]`` with one raw buffer (the offsets, little-endian
  int64): a consumer's pipelined acks, answered with how many were newly acked once
  durable. Acks are data as sends are: a Ray call each cost the consumer's process
  0.2-0.3 ms of CPU and the queue's actor its deserialisation (measured at 1k msg/s,
  one ack a message), where a frame on the connection the process has costs little.
  ``Consumer.ack(wait=True)`` uses it too, waiting for the answer.
- ``nack [consumer_id, subscription, delay]`` and ``reject [consumer_id, subscription]``
  with the offsets as ``ack``'s: a consumer gives messages back (delivered again after
  ``delay`` seconds, nil: the queue's ``redelivery_delay_s``) or dead-letters them,
  answered with how many (a nack's delay durable when answered). Through Ray each was a
  2.8 ms round trip here (``bench/consumer_calls.py``).

A server that stopped serving (its queue hibernates or stops) answers ``NotLeader``
(the client sends through Ray, which finds the queue's next actor) and closes once the
stores under way are answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from raymq import errors
from raymq.batch import MessageBatch
from raymq.properties import check_encoded_properties, id_in_properties
from raymq.wire.blocking import BlockingClient
from raymq.wire.client import PATIENCE_SECONDS, Answer
from raymq.wire.errors import WireBroken
from raymq.wire.server import DEFERRED, Op, Protocol, ProtocolServer, Request, WireServer

log = logging.getLogger("raymq.wire.send")

PROTOCOL = "send"
#: Room for a request's framing beside its body and properties (bytes).
FRAME_OVERHEAD = 64 * 1024
#: Connections a queue actor serves at once; more are closed at once.
MAX_CONNECTIONS = 256
#: After ``SendServer.close``, open connections are closed once the stores under way
#: are answered, or after this long at most (seconds).
CLOSE_GRACE_SECONDS = 5.0
#: A client waiting this long for an answer pings the server; a ping unanswered as long
#: again breaks the connection (seconds). A BLOCKed send may wait for ever, a dead peer not.
REPLY_PATIENCE_SECONDS = PATIENCE_SECONDS

#: ``send_batch(batch, timeout)``: store a batch, (first offset, count stored).
SendBatch = Callable[[MessageBatch, "float | None"], Awaitable[tuple[int, int]]]
#: ``send_ids(batch, ids, timeout)``: store a batch of messages with producer ids (None:
#: none), each message's offset (a duplicate's: the first one's; None: DROPped).
SendIds = Callable[[MessageBatch, list, "float | None"], Awaitable[list]]
#: ``ack(consumer_id, offsets, subscription)``: acknowledge, how many newly acked once
#: durable (``QueueActor.ack``).
Ack = Callable[[str, np.ndarray, "str | None"], Awaitable[int]]
#: ``nack(consumer_id, offsets, subscription, delay)``: give back for redelivery after
#: ``delay`` seconds (None: the queue's), how many (``QueueActor.nack``).
Nack = Callable[[str, np.ndarray, "str | None", "float | None"], Awaitable[int]]
#: ``reject(consumer_id, offsets, subscription)``: dead-letter, how many
#: (``QueueActor.reject``).
Reject = Callable[[str, np.ndarray, "str | None"], Awaitable[int]]
#: Offsets one ``ack`` (``nack``, ``reject``) carries at most: 64 KiB of them, within
#: ``FRAME_OVERHEAD``, so under any ``max_message_size`` (more go by a Ray call).
MAX_ACK_OFFSETS = FRAME_OVERHEAD // 8


# -- the queue actor's side -------------------------------------------------------------


class SendServer(ProtocolServer):
    """Serves one queue's sends: ``send_batch(batch, timeout)`` stores a batch and
    returns (first offset, count stored), as ``QueueCore.send_batch`` does.

    ``gather`` False: each single send is stored as a batch of its own (a queue whose
    ``address_full_policy`` FAIL or BLOCK judges a batch whole must not refuse a send
    that fits because another shared its batch; the group commit still writes them
    together)."""

    def __init__(
        self,
        send_batch: SendBatch,
        queue: str,
        max_message_size: int,
        *,
        gather: bool = True,
        send_ids: SendIds | None = None,
        ack: Ack | None = None,
        nack: Nack | None = None,
        reject: Reject | None = None,
    ):
        self._send_batch = send_batch
        self._send_ids = send_ids
        self._ack = ack
        self._nack = nack
        self._reject = reject
        self._gathers = gather
        self._queue = queue
        self._max_message_size = max_message_size
        self._where = f"a message for queue {queue!r}"
        # Single sends gathered since the last flush: (body, properties, timeout, request).
        self._gathered: list[tuple[bytes, bytes, float | None, Request]] = []
        limit = max_message_size + FRAME_OVERHEAD
        ops = {
            "send": Op(self._send, _check_send),
            "send_batch": Op(self._batch, _check_batch, max_buffers=4),
        }
        if ack is not None:
            ops["ack"] = Op(self._acks, _check_ack, max_buffers=1)
        if nack is not None:
            ops["nack"] = Op(self._nacks, _check_nack, max_buffers=1)
        if reject is not None:
            ops["reject"] = Op(self._rejects, _check_reject, max_buffers=1)
        protocol = Protocol(
            PROTOCOL,
            ops,
            request_limit=limit,
            payload_limit=limit,
            max_connections=MAX_CONNECTIONS,
        )
        self.server = WireServer(protocol, f"queue {queue!r}")

    def close(self) -> None:
        """Stop serving (the queue hibernates or stops): requests from now on, and those
        gathered but not yet handed to the queue, are answered ``NotLeader``; open
        connections close once the stores under way are answered, at most
        ``CLOSE_GRACE_SECONDS`` later. Call it on the event loop's thread."""
        refusal = errors.NotLeader(
            f"queue {self._queue!r} is not served here any more: ask the broker again"
        )
        gathered, self._gathered = self._gathered, []
        for *_, request in gathered:  # not handed to the queue yet: refused, never half stored
            request.fail(refusal)
        self.server.close(refusal, CLOSE_GRACE_SECONDS)

    def _send(self, request: Request) -> object:
        body, props, timeout = request.args
        if len(body) + len(props) > self._max_message_size:
            # The queue counts properties toward max_message_size; checked here, not in
            # the gathered batch, where it would fail every message of the gather.
            raise errors.MessageTooLarge(
                f"message 0 for queue {self._queue!r} is {len(body) + len(props)} bytes;"
                f" max_message_size is {self._max_message_size}"
            )
        if props:  # b"": no properties, nothing to decode
            check_encoded_properties(props, where=self._where)
        if not self._gathered:
            # After every request already received is decoded (in the same callback):
            # those arriving together share one commit.
            asyncio.get_running_loop().call_soon(self._flush)
        self._gathered.append((body, props, timeout, request))
        return DEFERRED

    def _batch(self, request: Request) -> Awaitable[object]:
        (timeout,) = request.args
        if self._gathered:  # single sends received before it are stored before it
            self._flush()
        batch = MessageBatch.from_wire(request.buffers, self._queue)  # ValueError: its answer

        async def store() -> object:
            first, count = await self._send_batch(batch, timeout)
            # Answered here, not when the task's end is seen a turn of the loop later:
            # its sender waits. Flushed at the end of this turn, with the answers of the
            # other batches the same commit stored (a pipelining producer has several).
            request.answer([first, count])
            return DEFERRED

        return store()

    def _acks(self, request: Request) -> Awaitable[int]:
        consumer_id, subscription = request.args
        assert self._ack is not None  # (the op exists only with it)
        return self._ack(consumer_id, _offsets(request), subscription)

    def _nacks(self, request: Request) -> Awaitable[int]:
        consumer_id, subscription, delay = request.args
        assert self._nack is not None
        return self._nack(consumer_id, _offsets(request), subscription, delay)

    def _rejects(self, request: Request) -> Awaitable[int]:
        consumer_id, subscription = request.args
        assert self._reject is not None
        return self._reject(consumer_id, _offsets(request), subscription)

    def _flush(self) -> None:
        gathered, self._gathered = self._gathered, []
        if not gathered:  # refused by close() meanwhile
            return
        if not self._gathers:
            for item in gathered:  # in the order received: the queue keeps it
                self._spawn([item])
            return
        # One timeout per stored batch: runs of equal timeouts, in the order received
        # (the queue stores the tasks' batches in the order they start).
        run = [gathered[0]]
        for item in gathered[1:]:
            if item[2] != run[0][2]:
                self._spawn(run)
                run = []
            run.append(item)
        self._spawn(run)

    def _spawn(self, items: list) -> None:
        self.server.spawn(self._store(items))  # a closing server waits for it

    async def _store(self, items: list) -> None:
        """Store gathered single sends as one batch and answer each."""
        try:
            batch = MessageBatch.from_encoded([i[0] for i in items], [i[1] for i in items])
            ids = [id_in_properties(i[1]) for i in items] if self._send_ids else []
            if any(ids):  # producer ids: each send answered with its own offset
                assert self._send_ids is not None
                offsets = await self._send_ids(batch, ids, items[0][2])
            else:
                first, count = await self._send_batch(batch, items[0][2])
                offsets = [first + k if k < count else None for k in range(len(items))]
        except Exception as exc:  # every request of the batch gets the error
            for *_, request in items:
                request.fail(exc)
            return
        connections = set()
        for offset, (*_, request) in zip(offsets, items, strict=True):
            if request.answer(offset):  # None: DROPped
                connections.add(request.conn)
        for conn in connections:  # now, not a turn of the loop later: the sender waits
            conn.flush()


def _check_send(args: list, buffers: list) -> None:
    if len(args) != 3:
        raise ValueError("send takes [body, properties, timeout]")
    body, props, timeout = args
    if not isinstance(body, bytes) or not isinstance(props, bytes):
        raise TypeError("send: body and properties as bytes")
    _check_timeout(timeout)


def _check_batch(args: list, buffers: list) -> None:
    if len(args) != 1 or len(buffers) != 4:
        raise ValueError("send_batch takes [timeout] and four raw buffers")
    _check_timeout(args[0])


def _offsets(request: Request) -> np.ndarray:
    """An ``ack``'s (``nack``'s, ``reject``'s) offsets; a copy: the frame's buffer is
    the connection's, reused for the next frames."""
    return np.frombuffer(request.buffers[0], dtype="<i8").astype(np.int64)


def _check_ack(args: list, buffers: list) -> None:
    """``ack``: ``[consumer_id, subscription]`` and the offsets."""
    if len(args) != 2 or len(buffers) != 1:
        raise ValueError("ack takes [consumer_id, subscription] and one raw buffer")
    _check_consumer_offsets("ack", args, buffers)


def _check_reject(args: list, buffers: list) -> None:
    """``reject``: as ``ack``."""
    if len(args) != 2 or len(buffers) != 1:
        raise ValueError("reject takes [consumer_id, subscription] and one raw buffer")
    _check_consumer_offsets("reject", args, buffers)


def _check_nack(args: list, buffers: list) -> None:
    """``nack``: ``[consumer_id, subscription, delay]`` and the offsets; the delay's
    range is the queue's to judge (``InvalidSetting`` naming it)."""
    if len(args) != 3 or len(buffers) != 1:
        raise ValueError("nack takes [consumer_id, subscription, delay] and one raw buffer")
    delay = args[2]
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int | float)):
        raise TypeError(f"nack: delay {delay!r:.40} is not a number of seconds or nil")
    _check_consumer_offsets("nack", args, buffers)


def _check_consumer_offsets(op: str, args: list, buffers: list) -> None:
    consumer_id, subscription = args[:2]
    if not isinstance(consumer_id, str) or not (
        subscription is None or isinstance(subscription, str)
    ):
        raise TypeError(f"{op}: consumer_id as a string, subscription as a string or nil")
    size = memoryview(buffers[0]).nbytes
    if size % 8 or size > MAX_ACK_OFFSETS * 8:
        raise ValueError(f"{op}: {size} bytes of offsets (int64 each, {MAX_ACK_OFFSETS} at most)")


def _check_timeout(value: object) -> None:
    """None or a number of seconds >= 0 (not a bool)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:  # NaN
        raise TypeError(f"send: timeout {value!r:.40}")


# -- the client's side -------------------------------------------------------------------


class SendChannel:
    """This process's connection to one queue actor's ``SendServer``, shared by its
    threads (a ``BlockingClient``). Once broken it stays broken: every waiting and
    later send raises ``WireBroken`` (the message may have been stored: at-least-once,
    as any retried send).

    ``submit_one`` / ``submit_batch`` send without waiting: the answer goes to a reply
    object's ``set_result`` / ``set_exception``, called on the wire loop's thread."""

    def __init__(self, host: str, port: int, secret: str, queue: str):
        self.queue = queue
        self._client = BlockingClient(
            (host, port, secret), PROTOCOL, f"queue {queue!r}", patience=REPLY_PATIENCE_SECONDS
        )

    @property
    def broken(self) -> WireBroken | None:
        """Why the connection broke (None while it works)."""
        return self._client.broken

    def send(self, body: bytes, properties: bytes, timeout: float | None) -> int | None:
        """Store one message; returns its offset once durable (None: DROPped). Raises
        the queue's typed error, or ``WireBroken``."""
        return self._client.call("send", [body, properties, timeout]).value

    def send_batch(self, batch: MessageBatch, timeout: float | None) -> tuple[int, int]:
        """Store a batch; returns (first offset, count stored) once durable."""
        first, count = self._client.call("send_batch", [timeout], batch.wire_buffers()).value
        return first, count

    def submit_one(self, body: bytes, properties: bytes, timeout: float | None, reply: Any) -> None:
        """Send one message without waiting: ``reply.set_result(offset)`` (None:
        DROPped) once durable, or ``reply.set_exception(error)``. ``WireBroken`` at once
        (``reply`` not called) if the connection is known broken."""
        self._client.submit("send", [body, properties, timeout], (), _replier(reply))

    def submit_batch(self, batch: MessageBatch, timeout: float | None, reply: Any) -> None:
        """Send a batch without waiting: ``reply.set_result([first offset, count
        stored])`` once durable, or ``reply.set_exception(error)``; errors as
        ``submit_one``."""
        self._client.submit("send_batch", [timeout], batch.wire_buffers(), _replier(reply))

    def submit_ack(
        self, consumer_id: str, offsets: np.ndarray, subscription: str | None, reply: Any
    ) -> None:
        """Acknowledge ``offsets`` (at most ``MAX_ACK_OFFSETS``) without waiting:
        ``reply.set_result(newly acked)`` once durable, or ``reply.set_exception(error)``
        (the queue's typed error such as ``InvalidAck``; ``WireBroken``: the outcome is
        unknown). ``WireBroken`` at once if the connection is known broken."""
        data = np.ascontiguousarray(offsets, dtype="<i8")
        self._client.submit("ack", [consumer_id, subscription], (data,), _replier(reply))

    def serves(self, op: str) -> bool:
        """Whether the server has ``op`` (its hello's ``ops``: an older queue actor may
        lack a newer op, which then goes through Ray)."""
        return op in self._client.caps.get("ops", ())

    def consumer_call(
        self,
        op: str,
        consumer_id: str,
        offsets: np.ndarray,
        subscription: str | None,
        *more: Any,
    ) -> int:
        """A consumer's ``ack`` (waiting), ``nack`` (``more``: the delay, seconds or
        None) or ``reject`` of ``offsets`` (at most ``MAX_ACK_OFFSETS``), answered with
        how many once durable. Raises the queue's typed error (``InvalidAck``,
        ``InvalidSetting``), or ``WireBroken`` (``answer_pending``: the outcome is
        unknown)."""
        data = np.ascontiguousarray(offsets, dtype="<i8")
        return self._client.call(op, [consumer_id, subscription, *more], (data,)).value

    async def send_async(self, body: bytes, properties: bytes, timeout: float | None) -> int | None:
        """``send`` for asyncio code: awaits without blocking the loop."""
        return (await self._client.call_async("send", [body, properties, timeout])).value

    async def send_batch_async(self, batch: MessageBatch, timeout: float | None) -> tuple[int, int]:
        """``send_batch`` for asyncio code."""
        answer = await self._client.call_async("send_batch", [timeout], batch.wire_buffers())
        first, count = answer.value
        return first, count

    def close(self) -> None:
        """Close the connection; waiting sends raise ``WireBroken``."""
        self._client.close()


def _replier(reply: Any) -> Callable[[Answer | None, BaseException | None], None]:
    """``done`` for ``BlockingClient.submit`` telling a reply object (the producer's
    batches) its answer."""

    def done(answer: Answer | None, error: BaseException | None) -> None:
        if error is not None:
            reply.set_exception(error)
        else:
            reply.set_result(answer.value)  # type: ignore[union-attr]

    return done
