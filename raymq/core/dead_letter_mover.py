"""The dead-letter mover of a subscription: messages delivered ``max_delivery_attempts``
times, rejected, or expired wait, held by ``DEAD_LETTER_HOLDER``, until a background
task moves them a batch at a time to their queue (``raymq.core.dead_letter``): append
there durably, then ack here durably. ``DeadLetterMover`` is a part of ``Subscription``
(a base class of it), written apart so that each file has one job.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from raymq.core.dead_letter import (
    MOVE_BATCH_MESSAGES,
    REASON_EXPIRED,
    dead_letter_batch,
)
from raymq.core.target_area import DEAD_LETTER_HOLDER, TargetArea

log = logging.getLogger("raymq.queue")

#: Longest wait between two attempts to move dead letters that failed (seconds).
DEAD_LETTER_RETRY_MAX_SECONDS = 5.0
#: The first wait after a failed move (seconds), doubled up to the longest.
DEAD_LETTER_RETRY_FIRST_SECONDS = 0.1


class DeadLetterMover:
    """Moves a subscription's dead letters (the attributes below are
    ``Subscription``'s)."""

    name: str
    log: object
    host: object
    area: TargetArea
    dead_letter_address: str
    dead_lettered: int
    dead_letter_failures: int
    messages_expired: int
    _dead_letter_kick: asyncio.Event | None
    _dead_letters_moved: asyncio.Event | None
    _moving: bool

    def _signal_dead_letters(self) -> None:
        if self.area.dead_letters and self._dead_letter_kick is not None:
            self._dead_letter_kick.set()

    def _destination(self, reason: str) -> str | None:
        """Where a dead letter of ``reason`` goes (None: dropped, acknowledged)."""
        if reason == REASON_EXPIRED:
            return self.host.config.expiry_queue
        return self.dead_letter_address

    def _movable(self, limit: int) -> tuple[np.ndarray, list[str]]:
        """Up to ``limit`` waiting dead letters that can move now (sorted offsets, and
        each one's reason): without a sink, only those dropped."""
        offsets, reasons = self.area.next_dead_letters(limit)
        if self.host.dead_letter_sink is None and len(offsets):
            keep = [self._destination(r) is None for r in reasons]
            offsets = offsets[np.array(keep, dtype=np.bool_)]
            reasons = [r for r, k in zip(reasons, keep, strict=True) if k]
        return offsets, reasons

    async def dead_letters_settled(self) -> None:
        """Return once every dead letter that can move now has moved (or was dropped)."""
        while self._moving or len(self._movable(1)[0]):
            self._dead_letters_moved.clear()
            self._signal_dead_letters()
            await self._dead_letters_moved.wait()

    async def _move_dead_letters(self) -> None:
        """Move waiting dead letters to their queue, a batch at a time: append there
        durably, then ack here durably (a crash in between leaves a copy in both,
        never in neither); expired ones without an expiry queue are acked only. A
        failure is logged, counted and retried with backoff."""
        backoff = DEAD_LETTER_RETRY_FIRST_SECONDS
        while True:
            if not len(self._movable(1)[0]):
                self._dead_letter_kick.clear()
                await self._dead_letter_kick.wait()
                continue
            self._moving = True
            try:
                await self._move_dead_letter_batch()
                backoff = DEAD_LETTER_RETRY_FIRST_SECONDS
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the DLQ unavailable or full: try again later
                self.dead_letter_failures += 1
                log.warning(
                    "queue %r: moving %d dead letters failed (retry in %.1f s): %s",
                    self.name,
                    len(self.area.dead_letters),
                    backoff,
                    exc,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, DEAD_LETTER_RETRY_MAX_SECONDS)
            finally:
                self._moving = False
                self._dead_letters_moved.set()  # counted by now: dead_letters_settled

    async def _move_dead_letter_batch(self) -> None:
        """Move (or drop) one batch of dead letters, all with one destination."""
        offsets, reasons = self._movable(MOVE_BATCH_MESSAGES)
        dest = self._destination(reasons[0])
        same = [self._destination(r) == dest for r in reasons]
        offsets = offsets[np.array(same, dtype=np.bool_)]
        reasons = [r for r, k in zip(reasons, same, strict=True) if k]
        # Read (checked) even to drop: an expiry read from properties without their CRC
        # may be rot, and a damaged record is counted as damage, not as expired.
        runs = np.split(offsets, np.flatnonzero(np.diff(offsets) != 1) + 1)
        stored = [b for run in runs for b in self.log.read(int(run[0]), int(run[-1]) + 1)]
        self.host.forget_damaged()  # a damaged one is no longer a dead letter to move
        waiting = self.area.dead_letters
        readable = np.array([o in waiting for o in offsets.tolist()], dtype=np.bool_)
        offsets = offsets[readable]
        reasons = [r for r, ok in zip(reasons, readable.tolist(), strict=True) if ok]
        if not len(offsets):
            return
        if dest is not None:
            batch = dead_letter_batch(stored, offsets, reasons, self.name)
            await self.host.dead_letter_sink(dest, batch)
        await self.ack(DEAD_LETTER_HOLDER, offsets)
        expired = sum(r == REASON_EXPIRED for r in reasons)
        self.messages_expired += expired
        self.dead_lettered += len(offsets) - expired
        if dest is not None:
            log.info("queue %r: %d messages moved to %r", self.name, len(offsets), dest)
