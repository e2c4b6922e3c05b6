"""ScrubPacer: the pace of a queue's background scrub, which verifies the CRCs of
stored records so that rot is found (and quarantined) before a consumer needs the data.

The scrub reads on the event loop in small steps at ``scrub_bytes_per_second``, and
starts a pass over the queue's records at most every ``SCRUB_PASS_SECONDS``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from raymq.config import BrokerConfig, QueueConfig
from raymq.errors import StorageError
from raymq.storage import SegmentLog

log = logging.getLogger("raymq.queue")

#: Period of the background scrub's steps (seconds): each reads
#: ``scrub_bytes_per_second`` times this on the event loop (200 KiB at 4 MiB/s).
SCRUB_STEP_SECONDS = 0.05
#: Shortest time from the start of one scrub pass over a queue's records to the start
#: of the next (seconds). Without it a queue of a few records re-read them from disk at
#: every step, 20 times a second, idle or not.
SCRUB_PASS_SECONDS = 10.0


class ScrubPacer:
    """How much one queue's scrub may read now, and its loop."""

    def __init__(self, log_: SegmentLog, config: QueueConfig, broker: BrokerConfig):
        """The scrub reads ``broker.scrub_bytes_per_second`` (0 or less: no scrub); a
        non-durable queue is not scrubbed."""
        self.queue = config.name
        self.log = log_
        self.config = config
        self.broker = broker
        #: Bytes the scrub may read now (negative: read ahead of its rate).
        self.credit = 0.0

    def step(self, seconds: float) -> bool:
        """Verify about ``scrub_bytes_per_second * seconds`` stored bytes; False if
        nothing was to be read (no scrub here, or a debt still to pay)."""
        rate = self.broker.scrub_bytes_per_second
        if not self.config.durable or rate <= 0:
            return False
        # A step reads at least one whole record, which may be far over its share (a
        # 1 MiB producer batch against 200 KiB): the overshoot is a debt that later
        # steps pay by reading nothing, so the average stays at the rate. Unused share
        # does not pile up (an idle queue's next step is no bigger than any other).
        share = rate * seconds
        self.credit = min(self.credit + share, share)
        if self.credit <= 0:
            return False
        try:
            self.credit -= self.log.scrub_step(max(1, int(self.credit)))
        except StorageError as exc:  # unreadable now; counted by the log, tried again
            log.warning("queue %r: scrub: %s", self.queue, exc)
        return True

    async def run(self, scrub: Callable[[float], None]) -> None:
        """Call ``scrub(SCRUB_STEP_SECONDS)`` every ``SCRUB_STEP_SECONDS``: each step
        reads on the event loop, so one step a second held sends and fetches for tens of
        milliseconds (a delivery latency spike every second). A pass starts at most
        every ``SCRUB_PASS_SECONDS``."""
        loop = asyncio.get_running_loop()
        started = loop.time()  # the current pass's start
        while True:
            await asyncio.sleep(SCRUB_STEP_SECONDS)
            passes = self.log.scrub_passes
            scrub(SCRUB_STEP_SECONDS)
            if self.log.scrub_passes != passes:  # a pass ended: the next one waits
                await asyncio.sleep(max(0.0, started + SCRUB_PASS_SECONDS - loop.time()))
                started = loop.time()


__all__ = ["SCRUB_PASS_SECONDS", "SCRUB_STEP_SECONDS", "ScrubPacer"]
