"""Quarantine: a record found damaged while the queue runs (a read or the scrub).

Its messages are taken out of delivery for good (acknowledged, counted as damaged), its
bytes copied aside to ``<segment file>.damaged-<position>`` for inspection, and the
finding logged with the queue, the file and the offsets; everything else keeps flowing.
The queue learns the offsets with ``drain`` (to release them from whoever holds them).
"""

from __future__ import annotations

import logging

import numpy as np

from raymq.storage.ack_state import AckState
from raymq.storage.files import copy_aside
from raymq.storage.format import DAMAGED_SUFFIX
from raymq.storage.segment import Segment

log = logging.getLogger("raymq.storage")

#: What ``found`` and ``drain`` answer while nothing was found: every fetch asks twice,
#: so one shared read-only array rather than two new ones a delivery.
_NONE_FOUND = np.zeros(0, dtype=np.int64)
_NONE_FOUND.flags.writeable = False


class Quarantine:
    """Takes damaged records out of delivery and remembers what it took."""

    def __init__(self, queue: str, acks: AckState):
        self.queue = queue
        self.acks = acks
        #: Messages found damaged since the log was opened (not counting recovery).
        self.damaged_messages = 0
        self._found: list[np.ndarray] = []

    def take_out(self, seg: Segment, k: int, reason: str) -> int:
        """Quarantine record ``k`` of ``seg``; returns how many messages it took out
        (those not acknowledged already)."""
        first, end = seg.record_offsets(k)
        pos = seg.positions[k]
        held = seg.acked[first - seg.base_offset : end - seg.base_offset]
        offsets = np.arange(first, end, dtype=np.int64)[~held]
        dest = f"{seg.path}{DAMAGED_SUFFIX}-{pos}"
        kept = seg.fd is not None and copy_aside(seg.fd, pos, seg.record_end(k), dest)
        seg.note_damaged(k)
        fresh = self.acks.lose(seg, first, end)
        self.damaged_messages += fresh
        if len(offsets):
            self._found.append(offsets)
        log.log(
            logging.ERROR if fresh else logging.INFO,  # INFO: found again, all acked
            "queue %r: %s: record at byte %d (offsets %d..%d) is damaged (%s); %d messages "
            "taken out of delivery%s",
            self.queue,
            seg.path,
            pos,
            first,
            end,
            reason,
            fresh,
            f"; its bytes are kept in {dest}" if kept else "",
        )
        return fresh

    def found(self) -> np.ndarray:
        """Offsets quarantined since the last ``drain``, sorted, left to it."""
        if not self._found:
            return _NONE_FOUND
        return np.unique(np.concatenate(self._found))

    def drain(self) -> np.ndarray:
        """Offsets quarantined since the last call, sorted (the queue releases them from
        their holders: nobody will ever receive them)."""
        found = self.found()
        self._found = []
        return found
