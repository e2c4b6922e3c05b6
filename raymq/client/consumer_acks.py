"""``ConsumerAcks``: how a consumer settles what it received: acks pipelined (an
``AckPipeline``) or waited for, nacks and rejects, each to its queue's current actor.

A mixin of ``raymq.client.consumer.Consumer``. Every call goes as a frame on this
process's SendChannel to the queue's actor when one is open (``docs/WIRE.md`` "send"),
else, or when it broke, as a Ray call that follows the queue to its current actor. A
waited call over the wire costs about a fifth of a Ray call's round trip here
(``bench/consumer_calls.py``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import ray

from raymq.client import acks, calls
from raymq.client.acks import AckPipeline
from raymq.client.calls import _FAULTS, _RETRYABLE, _reason, _unwrap
from raymq.client.messages import Message, _offsets_of
from raymq.errors import InvalidAck, NotLeader
from raymq.ray_faults import ActorNotFound, submit
from raymq.wire.errors import WireBroken
from raymq.wire.send import MAX_ACK_OFFSETS, SendChannel

_log = logging.getLogger("raymq.client")

#: False: waited acks, nacks and rejects go through Ray calls only (the baseline of
#: ``bench/consumer_calls.py``), as before they went over the SendChannel.
WAITED_OVER_WIRE = True


class ConsumedQueue(Protocol):
    """What a consumer uses of its queue's handle (``raymq.client.handles.Queue``):
    named here so that this module does not import the handles'."""

    name: str
    actor_name: str
    subscription_name: str | None
    broker: Any
    _actor: Any
    _consumers: Any

    def _invoke(self, method: str, *args: Any, answer_seconds: float | None = -1.0) -> Any: ...
    def _fetch_endpoint(self, fresh: bool = False) -> tuple[Any, bool]: ...
    def _ack_channel(self) -> SendChannel | None: ...
    def _follow(self, failed: Any) -> None: ...


class ConsumerAcks:
    """Acks, nacks and rejects of a ``Consumer`` (which sets the attributes below)."""

    queue: ConsumedQueue
    consumer_id: str
    _subscription: str | None
    _acks: AckPipeline
    _ack_singles: list
    _closed: bool
    _acks_failing_since: float | None
    acks_lost: int
    acks_resent: int
    acks_over_wire: int
    #: Waited acks, nacks and rejects answered over the SendChannel (the others went by
    #: Ray call: no channel open yet, too many offsets, or it broke).
    calls_over_wire: int
    #: Waited calls whose connection broke after they were written, then refused by the
    #: queue's actor through Ray because it no longer let us settle those messages: the
    #: first one (or the actor's restart) had done so. Counted and logged, answered 0.
    calls_in_doubt: int

    def _check_open(self) -> None:
        raise NotImplementedError  # (Consumer's)

    @property
    def _actor(self) -> Any:
        raise NotImplementedError  # (Consumer's)

    def _waited_call(self, op: str, offsets: np.ndarray, *more: Any) -> int:
        """``op`` (``ack``, ``nack`` with ``more`` = its delay, ``reject``) of
        ``offsets``, waited for: over the SendChannel when open, else through Ray."""
        channel = self.queue._ack_channel() if len(offsets) <= MAX_ACK_OFFSETS else None
        in_doubt: WireBroken | None = None
        if channel is not None and WAITED_OVER_WIRE and channel.serves(op):
            try:
                n = channel.consumer_call(op, self.consumer_id, offsets, self._subscription, *more)
            except WireBroken as exc:  # through Ray, to the queue's current actor
                in_doubt = exc if exc.answer_pending else None
            except NotLeader:  # refused, nothing done: it stopped serving (hibernates)
                pass
            else:
                self.calls_over_wire += 1
                return n
        try:
            return self.queue._invoke(op, self.consumer_id, offsets, self._subscription, *more)
        except InvalidAck:
            if in_doubt is None:
                raise
            # Written before the connection broke: the queue's actor may have settled
            # them then (or was replaced, and delivers them again): not our error.
            self.calls_in_doubt += 1
            _log.warning(
                "queue %r: consumer %s: a %s of %d messages whose connection broke (%s) was"
                " refused when sent again: taken as done before",
                self.queue.name,
                self.consumer_id,
                op,
                len(offsets),
                in_doubt,
            )
            return 0

    def ack(
        self,
        messages: Message | int | Iterable | pa.RecordBatch | pa.Table,
        *,
        wait: bool = False,
    ) -> int | None:
        """Acknowledge messages (``Message`` objects, offsets, or a received batch).

        By default the ack is pipelined, as AMQP's are: it returns None at once and goes
        out with others as one call and one fsync when half the prefetch is gathered,
        after ``raymq.client.acks.ACK_LINGER_SECONDS``, before the consumer asks for more
        messages (from ``TRICKLE_ACKS`` gathered on), and on ``flush``, ``nack``,
        ``reject``, ``close`` and this queue handle's ``stats``/``browse``. Its outcome
        is checked as later ones are sent and by ``flush``/``close``, which raise the
        first error of an earlier one (such as ``InvalidAck``). A message whose ack had
        not reached the queue when this process died, or when the queue's actor died or
        moved, is delivered again (those are counted in ``acks_lost`` and logged).

        A pipelined offset the queue refuses (``InvalidAck``: never delivered, or held by
        another consumer) is reported alone: the other offsets gathered into the same
        call are acknowledged.

        ``wait=True`` sends it (with any gathered before it) and returns how many
        messages were newly acknowledged, once that is durable; refused, it raises
        ``InvalidAck`` and acknowledges none of ``messages``.
        """
        if type(messages) is Message and not wait and not self._closed:
            # The per-message loop: AckPipeline.add_one inlined (a call less per
            # message); no lock (list.append is atomic), no array.
            singles = self._ack_singles
            singles.append(messages[0])
            acks = self._acks
            if len(singles) + acks._unsent_count >= acks.batch_messages or not acks.lingering:
                acks._gathered()
            return None
        self._check_open()
        offsets = _offsets_of(messages)
        if wait:
            self._acks.send()
            self._acks.collect(block=False)
            # Refused, it changes nothing (as every typed error): the caller decides.
            return self._waited_call("ack", offsets)
        self._acks.add(offsets)
        return None

    def _send_acks(self, at_least: int = 1) -> None:
        """Send the gathered pipelined acks as one call (not waiting for it) if there
        are ``at_least`` of them, and check the calls that finished (a failure is raised
        by the next ack, flush or close): the linger thread only sends, so without this
        they would pile up."""
        if self._acks.unsent >= at_least:
            self._acks.send()
        full = self._acks.in_flight > self._acks.max_in_flight
        self._acks.collect(block=full, raise_errors=False)

    def _send_ack_call(self, offsets: np.ndarray) -> concurrent.futures.Future:
        """One gathered ack call to the queue's actor: over this process's SendChannel
        to it when open (a frame, not a Ray call), else by Ray."""
        actor = self._actor
        channel = self.queue._ack_channel() if len(offsets) <= MAX_ACK_OFFSETS else None
        fut: concurrent.futures.Future | None = None
        if channel is not None:
            fut = concurrent.futures.Future()
            try:
                channel.submit_ack(self.consumer_id, offsets, self._subscription, fut)
                self.acks_over_wire += 1
            except WireBroken:  # known broken: Ray carries this one
                fut = None
        if fut is None:
            try:
                fut = submit(actor.ack, self.consumer_id, offsets, self._subscription).future()
            except ActorNotFound as exc:  # a call that failed: checked (and sent again) as one
                fut = concurrent.futures.Future()
                fut.set_exception(exc)
        fut.raymq_actor = actor  # (whom it went to: _resend_acks)
        return fut

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every pipelined ack is durable, at most ``timeout`` seconds (None:
        ``raymq.acks.ACK_ANSWER_SECONDS``); raises the first error of an ack, then
        ``BrokerUnavailable`` naming the queue if the queue has not answered them all
        (those stay in flight: a later ``flush`` waits for them again)."""
        unanswered = self._acks.flush(timeout)
        if unanswered:
            seconds = acks.ACK_ANSWER_SECONDS if timeout is None else timeout
            raise acks.unanswered_error(f"queue {self.queue.name!r}", unanswered, seconds)

    def _check_ack_call(self, fut: concurrent.futures.Future, parts: list[np.ndarray]) -> None:
        """Raise the typed error of one finished ack call.

        Pipelined acks are tracked as futures: asking a future whether it is done is
        free, where ``ray.wait(..., timeout=0)`` costs about 2 ms a call here.
        """
        try:
            fut.result()
        except ray.exceptions.RayTaskError as exc:  # (first: it is an instance of its cause)
            if isinstance(exc.cause, _FAULTS):  # an actor the queue called: as ours
                self._resend_acks(fut, parts, _reason(exc.cause))
                return
            error: BaseException = _unwrap(exc)
        except _FAULTS as exc:
            self._resend_acks(fut, parts, _reason(exc))
            return
        except WireBroken as exc:  # the SendChannel broke: its outcome is unknown
            self._resend_acks(fut, parts, exc)
            return
        except Exception as exc:  # noqa: BLE001 - over the SendChannel: the queue's error
            error = exc
        else:
            self._acks_failing_since = None
            return
        if isinstance(error, InvalidAck):
            # The queue refused the whole gathered call for some offsets it does not
            # let us ack: apply the others, report the first refused one.
            offsets = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if len(offsets) > 1:
                error = self._ack_apart(offsets) or error
        if isinstance(error, NotLeader):
            self._resend_acks(fut, parts, error)
            return
        raise error from None

    def _resend_acks(
        self, failed: concurrent.futures.Future, parts: list[np.ndarray], why: object
    ) -> None:
        """An ack call did not reach the queue: its actor died, restarts or leads no
        more. The handle follows the queue to its current actor and the offsets go
        again with the next send (the new actor acks them, or drops stale copies:
        ``TargetArea.drop_stale``), for ``calls.RESTART_GRACE_SECONDS`` from the first
        failure of a row; after that they are counted lost (``_ack_lost``)."""
        now = time.monotonic()
        if self._acks_failing_since is None:
            self._acks_failing_since = now
        self.queue._follow(getattr(failed, "raymq_actor", None))
        if now - self._acks_failing_since > calls.RESTART_GRACE_SECONDS:
            self._ack_lost(parts, why)
            return
        self.acks_resent += sum(len(p) for p in parts)
        self._acks.requeue(parts)

    def _ack_lost(self, parts: list[np.ndarray], why: object) -> None:
        """Pipelined acks whose outcome is unknown (the queue's actor died, restarts, a
        replica took over, or it did not answer before the consumer closed): a message
        they did not reach is delivered again, as at-least-once allows. Counted and
        logged."""
        lost = sum(len(p) for p in parts)
        if not lost:
            return
        self.acks_lost += lost
        _log.warning(
            "queue %r: %d pipelined acks of consumer %s may be lost with the queue's actor"
            " (%s); their messages are delivered again unless the ack was stored",
            self.queue.name,
            lost,
            self.consumer_id,
            why,
        )

    def _ack_apart(self, offsets: np.ndarray) -> InvalidAck | None:
        """Ack ``offsets`` after the queue refused them together (changing nothing): one
        call acks those it accepts; returns its refusal of the others, if any. A call
        that fails otherwise is counted in ``acks_lost``."""
        try:
            ref = submit(self._actor.ack_acceptable, self.consumer_id, offsets, self._subscription)
        except ActorNotFound as exc:
            self._ack_lost([offsets], exc)
            return None
        try:
            _fresh, refusal = ray.get(ref, timeout=acks.ACK_ANSWER_SECONDS)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            self._ack_lost([offsets], f"unanswered in {acks.ACK_ANSWER_SECONDS} s")
            return None
        except ray.exceptions.RayTaskError as exc:
            error = _unwrap(exc)
            if isinstance(error, InvalidAck):
                return error
            self._ack_lost([offsets], error)
            return None
        except _RETRYABLE as exc:
            self._ack_lost([offsets], exc)
            return None
        return InvalidAck(refusal) if refusal else None

    def nack(
        self,
        messages: Message | int | Iterable | pa.RecordBatch | pa.Table,
        *,
        delay: float | None = None,
    ) -> int:
        """Give messages back: they are delivered again with ``delivery_count`` + 1,
        after ``delay`` seconds (None: the queue's ``redelivery_delay_s``; 0: at once).
        A delayed message holds no memory but its offset and keeps its delay across a
        restart of the queue (durable when this returns)."""
        self._check_open()
        self._send_acks()  # in order: what was acked before is not given back
        return self._waited_call("nack", _offsets_of(messages), delay)

    def reject(self, messages: Message | int | Iterable | pa.RecordBatch | pa.Table) -> int:
        """Give up on messages: they go to the queue's dead-letter queue (with
        ``RayMQDeadLetterReason`` "rejected") and are not delivered again here.

        Returns how many were taken; the move itself happens in the background (see
        ``dead_letters_pending`` and ``messages_dead_lettered`` in ``Queue.stats()``).
        """
        self._check_open()
        self._send_acks()  # in order, as for nack
        return self._waited_call("reject", _offsets_of(messages))
