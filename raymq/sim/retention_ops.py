"""The fault simulator's side of an address's retention and its subscriptions' seeks.

A seed of an address draws a retention (``retention_s``, ``retention_bytes``; drawn from
a generator of its own, so that a seed without retention runs what it ran before) and,
with one, seeks: a subscription moves to "earliest", "latest" or an offset. What the
simulator expects after a seek: below the offset, nothing again; from it on, every
message routed to the subscription that the address certainly still stores comes again
(one some other subscription has not acknowledged, or one sent within ``retention_s``),
others may. Invariant at the end: nothing sent within ``retention_s`` was deleted (it is
not acknowledged in the log), whatever every subscription acknowledged.
"""

from __future__ import annotations

import random

import msgpack
import numpy as np

from raymq.core.queue import QueueCore
from raymq.errors import DurabilityUnknown, StorageError
from raymq.sim.disk import SimDisk
from raymq.sim.model import FILTERS, Message, SimClock, SimSubscription, Violation

#: Mixed into a seed for the generator of its retention and seeks.
RETENTION_SALT = 0x5E7E
#: An address's retention as a seed draws it: (retention_s, retention_bytes).
RETENTIONS = ((None, None), (None, None), (0.5, None), (3.0, None), (None, 16384), (1.0, 65536))


class RetentionOps:
    """The seek operation and the retention's checks, mixed into ``Simulation``."""

    core: QueueCore
    disk: SimDisk
    clock: SimClock
    messages: list[Message]
    subs: dict[str, SimSubscription]
    counts: dict[str, int]
    retention: tuple[float | None, int | None]
    retention_rng: random.Random
    flipped: list[str]
    holes: bool
    indexed_from: int

    def _note(self, what: str) -> None:
        """Add ``what`` to the run's trace (``Simulation._note``)."""
        raise NotImplementedError

    @property
    def retains(self) -> bool:
        """The address keeps what every subscription acknowledged."""
        return self.retention != (None, None)

    async def _op_seek(self) -> None:
        names = [n for n, s in self.subs.items() if s.state == "live"]
        if not names:
            return
        rng = self.retention_rng
        name = rng.choice(names)
        position = rng.choice(["earliest", "latest", rng.randrange(self.core.log.next_offset + 1)])
        self._note(f"  seek {name} to {position}")
        try:
            at = await self.core.seek(name, position)
        except StorageError as exc:  # undone, or in effect but maybe not durable
            self._note(f"  seek raised {exc}")
            if self.disk.image is not None or isinstance(exc, DurabilityUnknown):
                self._seek_in_doubt(name)
            return
        if self.disk.image is not None:
            self._seek_in_doubt(name)
            return
        self.counts["seeks"] += 1
        select = FILTERS[self.subs[name].filter]
        self.indexed_from = self.core.log.next_offset  # priorities: found again by a pass
        for m in self.messages:
            props = msgpack.unpackb(m.properties) if m.properties else None
            if m.offset is None:  # where it is is not known: it may come again
                if m.state in ("stored", "doubt") and (name in m.routes or select(props)):
                    m.routes[name] = "doubt"
                continue
            # Sent before it existed, or routed nowhere: its own now, if selected.
            if name not in m.routes and (m.offset < at or not select(props)):
                continue
            # Below the offset, or one its filter rejects (a seek routes the backlog
            # again: one an in-doubt create left it may be dropped now).
            if m.offset < at or not select(props):
                m.routes[name] = "yes"
            else:
                m.routes[name] = "" if self._certainly_stored(m, name) else "doubt"

    def _seek_in_doubt(self, name: str) -> None:
        """A seek of unknown outcome: any message it selects may come again, or not."""
        select = FILTERS[self.subs[name].filter]
        for m in self.messages:
            props = msgpack.unpackb(m.properties) if m.properties else None
            if name in m.routes or (m.state in ("stored", "doubt") and select(props)):
                m.routes[name] = "doubt"

    def _certainly_stored(self, m: Message, name: str) -> bool:
        """Whether the address certainly still stores ``m`` (stored, not lost)."""
        if m.state != "stored" or self.flipped or self.holes:
            return False
        live = {n for n, s in self.subs.items() if s.state == "live"}
        if any(r == "" for s, r in m.routes.items() if s in live):
            return True  # a subscription (this one too) has not acknowledged it
        return self._retained(m)

    def _retained(self, m: Message) -> bool:
        """Whether the retention certainly keeps ``m`` now: stored, sent within
        ``retention_s`` (its segment's newest record is newer still), nothing rotten."""
        retention_s = self.retention[0]
        return (
            retention_s is not None
            and m.state == "stored"
            and not (self.flipped or self.holes)
            and self.clock.time() - m.sent_at < retention_s
        )

    def _check_retention(self) -> None:
        """Nothing sent within ``retention_s`` is deleted (acknowledged in the log)."""
        retention_s = self.retention[0]
        if retention_s is None or self.flipped or self.holes:
            return
        now = self.clock.time()
        young = [
            m.offset
            for m in self.messages
            if m.state == "stored" and m.offset is not None and now - m.sent_at < retention_s
        ]
        if not young:
            return
        gone = np.array(young, dtype=np.int64)[self.core.log.is_acked(np.array(young))]
        if len(gone):
            raise Violation(f"retention deleted offsets {gone[:10].tolist()} within retention_s")


__all__ = ["RETENTIONS", "RETENTION_SALT", "RetentionOps"]
