"""CallBatcher: calls from many threads to one actor, gathered into shared calls.

Each thread's ``call(op, args)`` joins the open batch. If no batch is on its way, the
caller sends the open one itself (``send(calls) -> answers``, blocking) and hands every
waiter its answer; calls arriving meanwhile form the next batch, sent by the first of
their callers to find the way free. One actor call (and one commit there) then serves
as many calls as arrived during the previous one: the group commit of the producers'
sends, on the client side. Ray-free: ``send`` is injected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: (op, args) pairs, in arrival order.
Calls = list[tuple[str, tuple]]


class _Slot:
    __slots__ = ("answer", "done", "error")

    def __init__(self) -> None:
        self.done = False
        self.answer: Any = None
        self.error: BaseException | None = None


class CallBatcher:
    """Gathers concurrent calls into batches sent one at a time."""

    def __init__(self, send: Callable[[Calls], list[Any]], max_batch: int = 256) -> None:
        """``send(calls)`` returns one answer per call: a value, or an exception
        instance that the call raises. ``max_batch``: most calls per batch."""
        self._send = send
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._open: list[tuple[str, tuple, _Slot]] = []
        self._sending = False
        #: Batches sent and calls they carried (calls / batches: the sharing).
        self.batches = 0
        self.calls = 0

    def call(self, op: str, args: tuple) -> Any:
        """Run ``op(*args)`` in a shared batch; its answer, or its exception raised."""
        slot = _Slot()
        with self._cond:
            self._open.append((op, args, slot))
        while True:
            with self._cond:
                while not slot.done and self._sending:
                    self._cond.wait()
                if slot.done:
                    break
                # The way is free and this call is not answered: send the oldest calls
                # (this one among them, or in a later batch this caller sends too).
                batch, self._open = self._open[: self.max_batch], self._open[self.max_batch :]
                self._sending = True
            self._send_batch(batch)
        if slot.error is not None:
            raise slot.error
        return slot.answer

    def _send_batch(self, batch: list[tuple[str, tuple, _Slot]]) -> None:
        try:
            answers = self._send([(op, args) for op, args, _ in batch])
            if len(answers) != len(batch):
                raise RuntimeError(f"{len(answers)} answers to {len(batch)} calls")
        except BaseException as exc:  # every caller of the batch hears of it
            answers = [exc] * len(batch)
        with self._cond:
            for (_, _, slot), answer in zip(batch, answers, strict=True):
                if isinstance(answer, BaseException):
                    slot.error = answer
                else:
                    slot.answer = answer
                slot.done = True
            self.batches += 1
            self.calls += len(batch)
            self._sending = False
            self._cond.notify_all()
