"""QueueLink: how a client reaches a queue's current actor, whatever happened to it.

A queue's actor can restart in place after a crash, move (a replicated queue's leader
fails over, possibly because its node is gone: Ray then calls the old actor
"unschedulable"), hibernate and be revived as a new actor, be ended, or stop answering
(a paused process). A handle that talks to it must, on every call, either follow the
queue to its current actor or raise a typed error naming the queue, never a raw Ray
error, and never wait without a bound.

This is that decision, written once and free of Ray: the client's Ray shell gives it a
``Transport`` (one call on one actor handle, Ray's failures translated into
``LinkFault``) and a ``Locator`` (the broker: "which actor serves this queue now, this
one failed"); the clock and the sleep are injected, so tests drive every case with a
fake endpoint in microseconds (``tests/test_link.py``).

The rules:

- a typed RayMQ error from the queue is the call's answer: raised as it is, except
  ``NotLeader`` (a fault of kind MOVED);
- any fault asks the locator for the queue's actor again (once per failed actor: a
  thread that finds the handle already replaced retries on the new one);
- a locator failure of kind "no such queue" (``QueueNotFound``) is final; any other is
  retried, as the fault itself is;
- retries go on with backoff for at most ``grace_seconds`` from the first fault, then
  ``BrokerUnavailable`` naming the queue and the last fault;
- each attempt waits at most the grace left, or ``attempt_seconds`` if that is longer
  (a call that reached a live actor is given time to finish), plus what the call waits
  by design (``answer_seconds``). One that was not answered in that time (``SILENT``:
  a paused process) ends the call with ``BrokerUnavailable`` at once: its outcome is
  unknown, and a send tried again could be stored twice.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from raymq.errors import BrokerUnavailable, NotLeader, QueueNotFound

#: How long a call keeps following a queue whose actor failed (seconds): as long as a
#: restarting actor or a failover takes on a loaded machine.
RESTART_GRACE_SECONDS = 60.0
#: Least time one attempt may wait for its answer, whatever is left of the grace: a
#: call that reached its actor is given time to finish (seconds).
ATTEMPT_SECONDS = 60.0
#: First and longest pause between attempts (seconds).
RETRY_FIRST_SECONDS = 0.05
RETRY_MAX_SECONDS = 1.0


class Fault(enum.Enum):
    """Why a call did not reach the queue's actor, as the transport saw it."""

    #: The actor restarts in place (Ray: unavailable): the same handle comes back.
    RESTARTING = "restarting"
    #: The actor died (killed, crashed for good, hibernated and ended).
    GONE = "gone"
    #: Another actor serves the queue now (not the leader; its node is gone).
    MOVED = "moved"
    #: No answer within the time the attempt had (a paused or overloaded process).
    SILENT = "silent"
    #: The call failed on its way for another reason (a transport error).
    FAILED = "failed"


class LinkFault(Exception):
    """A call that did not reach (or was not answered by) the actor: ``kind`` says
    why, ``cause`` is the transport's own exception (for the message only); ``final``
    (with GONE): the actor could not start again."""

    def __init__(self, kind: Fault, cause: object = None, *, final: bool = False):
        super().__init__(f"{kind.value}: {cause}" if cause is not None else kind.value)
        self.kind = kind
        self.cause = cause
        self.final = final

    def __reduce__(self):
        # Pickled by kind, the cause's text and final: the default (the message as the
        # one argument) cannot be rebuilt, and Ray turned one crossing it into a raw
        # UnserializableException.
        cause = None if self.cause is None else str(self.cause)
        return (_link_fault, (self.kind, cause, self.final))


def _link_fault(kind: Fault, cause: str | None, final: bool) -> LinkFault:
    return LinkFault(kind, cause, final=final)


class Transport(Protocol):
    """One call on one actor handle."""

    def call(self, handle: Any, method: str, args: tuple, timeout: float | None) -> Any:
        """``method(*args)`` on ``handle``, waiting at most ``timeout`` seconds (None:
        no bound); its answer, its typed ``RayMQError``, or a ``LinkFault``."""
        ...


class Locator(Protocol):
    """Finds the actor that serves a queue now (the broker)."""

    def locate(self, failed: Any) -> Any:
        """The queue's current actor, ``failed`` being the one that just failed (the
        broker checks a leader suspected this way, and fails over or revives).
        Raises ``QueueNotFound`` if the queue is gone, another ``RayMQError`` if it
        cannot tell now."""
        ...


@dataclass(frozen=True)
class LinkStats:
    """What a link went through: ``faults`` by kind, ``follows`` (new actors found),
    ``locate_failures`` (the locator could not tell) and the ``last_fault``."""

    faults: dict[str, int]
    follows: int
    locate_failures: int
    last_fault: str


class QueueLink:
    """A client's link to one queue's current actor (thread-safe)."""

    def __init__(
        self,
        about: str,
        handle: Any,
        transport: Transport,
        locator: Locator,
        *,
        grace_seconds: float | Callable[[], float] | None = None,
        attempt_seconds: float = ATTEMPT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        #: What the link serves, as errors name it ("queue 'orders'").
        self.about = about
        self._handle = handle
        self._transport = transport
        self._locator = locator
        self._grace = grace_seconds
        self._attempt_seconds = attempt_seconds
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._faults: Counter[str] = Counter()
        self._follows = 0
        self._locate_failures = 0
        self._last_fault = ""

    @property
    def handle(self) -> Any:
        """The actor this link believes serves the queue now."""
        return self._handle

    @handle.setter
    def handle(self, handle: Any) -> None:
        self._handle = handle

    def grace_seconds(self) -> float:
        """The retry budget of one call (seconds): as given (a function is asked each
        time), else the module's ``RESTART_GRACE_SECONDS``."""
        grace = self._grace
        if grace is None:
            return RESTART_GRACE_SECONDS
        return grace() if callable(grace) else grace

    def call(self, method: str, *args: Any, answer_seconds: float | None = -1.0) -> Any:
        """``method(*args)`` on the queue's current actor, following it as the module
        says. ``answer_seconds`` bounds one attempt's wait beyond the grace left (for
        calls that wait by design, such as a send into a BLOCK queue: None for no
        bound); by default an attempt waits at most the grace left."""
        deadline: float | None = None  # set at the first fault
        delay = RETRY_FIRST_SECONDS
        while True:
            handle = self._handle
            if answer_seconds is None:
                timeout = None
            else:
                left = self.grace_seconds() if deadline is None else deadline - self._clock()
                timeout = max(left, self._attempt_seconds) + max(answer_seconds, 0.0)
            try:
                return self._transport.call(handle, method, args, timeout)
            except NotLeader as exc:
                fault = LinkFault(Fault.MOVED, exc)
            except LinkFault as exc:
                fault = exc
            now = self._clock()
            if deadline is None:
                deadline = now + self.grace_seconds()
            self.fault_seen(fault)
            if fault.kind is Fault.SILENT:
                # Its outcome is unknown (a send may be stored yet): not tried again.
                raise BrokerUnavailable(
                    f"{self.about}: its actor did not answer {method} ({fault}); whether"
                    " the call took effect is unknown"
                ) from fault
            if now >= deadline:
                raise BrokerUnavailable(
                    f"{self.about}: its actor could not be reached for"
                    f" {self.grace_seconds():g} s ({fault})"
                ) from fault
            if not self.follow(handle) and fault.final:
                # Gone for good (Ray knows no such actor) and no other named: waiting
                # out the grace would only delay the same answer.
                raise BrokerUnavailable(
                    f"{self.about}: its actor is gone for good and no other serves it ({fault})"
                ) from fault
            self._sleep(min(delay, max(deadline - self._clock(), 0.0)))
            delay = min(delay * 2, RETRY_MAX_SECONDS)

    def fault_seen(self, fault: LinkFault) -> None:
        """Count ``fault`` (calls made outside ``call``, such as pipelined acks, report
        theirs here too)."""
        with self._lock:
            self._faults[fault.kind.value] += 1
            self._last_fault = str(fault)

    def follow(self, failed: Any) -> bool:
        """Ask the locator for the queue's actor, ``failed`` having failed; True if the
        link now points elsewhere. Once per failed actor: if the link moved on already
        (another thread followed), nothing is asked. ``QueueNotFound`` is raised (the
        queue is gone: final); other locator errors are counted and the link stays
        where it is, for the next attempt."""
        if failed is not self._handle:
            return True
        try:
            found = self._locator.locate(failed)
        except QueueNotFound:
            raise
        except Exception as exc:  # noqa: BLE001 - counted; the caller's retry asks again
            with self._lock:
                self._locate_failures += 1
                self._last_fault = f"locating failed: {exc}"
            return False
        with self._lock:
            if self._handle is failed:
                self._handle = found
                if found is not failed:
                    self._follows += 1
        return found is not failed

    def stats(self) -> LinkStats:
        """A snapshot of the link's history."""
        with self._lock:
            return LinkStats(
                faults=dict(self._faults),
                follows=self._follows,
                locate_failures=self._locate_failures,
                last_fault=self._last_fault,
            )
