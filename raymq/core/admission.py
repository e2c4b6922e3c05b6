"""Admission of sends to a queue: the checks a batch passes before anything is stored,
and Artemis's address-full policy at ``max_size_bytes`` (PAGE, DROP, FAIL, BLOCK).

Interleaving: ``Admission.admit`` may wait (BLOCK) at an ``await``; every change of
its state (``reserved``, ``blocked``, ``dropped``) is one synchronous step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from raymq.batch import MessageBatch, check_sizes
from raymq.config import QueueConfig
from raymq.errors import AddressFull
from raymq.properties import check_encoded_properties
from raymq.storage import SegmentLog


class Admission:
    """One queue's address-full policy: what counts against ``max_size_bytes`` (stored
    unacknowledged messages plus admitted sends not yet published), which sends wait
    (BLOCK, first blocked first admitted) and what is dropped (DROP)."""

    def __init__(self, name: str, config: QueueConfig, log: SegmentLog):
        self.name = name
        self.config = config
        self.log = log
        self.reserved = 0  # bytes of admitted sends not yet published
        self.blocked: dict[object, float] = {}  # blocked sends, in order -> monotonic start
        self.dropped = 0  # messages DROP did not store
        self._freed: asyncio.Event | None = None

    def start(self) -> None:
        """Ready the event that wakes blocked sends, on the running event loop."""
        self._freed = asyncio.Event()

    def limited(self) -> bool:
        """True if ``max_size_bytes`` bounds this queue (a policy other than PAGE)."""
        return self.config.max_size_bytes > 0 and self.config.address_full_policy != "PAGE"

    def queued_bytes(self) -> int:
        """Bytes counted against ``max_size_bytes``: stored unacknowledged messages plus
        admitted sends not yet written."""
        return self.log.bytes_queued + self.reserved

    def full_message(self, need: int) -> str:
        """Why a batch of ``need`` bytes does not fit, for ``AddressFull`` and stats."""
        cfg = self.config
        return (
            f"queue {self.name!r} holds {self.queued_bytes():,} of max_size_bytes="
            f"{cfg.max_size_bytes:,} bytes; a batch of {need:,} bytes does not fit"
            f" (address_full_policy={cfg.address_full_policy})"
        )

    async def admit(self, batch: MessageBatch, timeout: float | None) -> MessageBatch:
        """Apply ``address_full_policy``; returns what may be stored (maybe nothing).
        BLOCK waits up to ``timeout`` seconds (None: for ever)."""
        if not self.limited():
            return batch
        limit, policy = self.config.max_size_bytes, self.config.address_full_policy
        need = batch_cost(batch)
        # Under BLOCK a send that fits still queues behind blocked ones (FIFO), or a
        # stream of small sends would starve a blocked larger one.
        if self.queued_bytes() + need <= limit and not (policy == "BLOCK" and self.blocked):
            return batch
        if policy == "FAIL" or (policy == "BLOCK" and need > limit):
            raise AddressFull(self.full_message(need))
        if policy == "DROP":
            room = limit - self.queued_bytes()
            sizes = np.diff(batch.body_offsets) + np.diff(batch.prop_offsets) + 24
            fits = int(np.searchsorted(np.cumsum(sizes), room, side="right"))
            self.dropped += len(batch) - fits
            return batch.slice(0, fits)
        await self._wait_for_room(need, timeout)
        return batch

    async def _wait_for_room(self, need: int, timeout: float | None) -> None:
        """BLOCK: wait for acks to free room, first blocked first admitted; visible in
        stats while waiting. ``AddressFull`` after ``timeout`` seconds."""
        limit = self.config.max_size_bytes
        key, started = object(), time.monotonic()
        deadline = None if timeout is None else started + max(timeout, 0.0)
        self.blocked[key] = started  # dicts keep insertion order: the FIFO
        try:
            while next(iter(self.blocked)) is not key or self.queued_bytes() + need > limit:
                freed = self._freed
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise AddressFull(
                        self.full_message(need) + f"; blocked {time.monotonic() - started:.1f} s"
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(freed.wait(), wait)
        finally:
            del self.blocked[key]
            if self.blocked:  # the next in line may fit now, or its turn came
                self.signal_freed()

    def signal_freed(self) -> None:
        """Wake producers blocked on ``max_size_bytes`` (acks freed room)."""
        if self._freed is not None:
            self._freed.set()
            self._freed = asyncio.Event()

    def blocked_seconds(self, now: float) -> float:
        """How long the longest-blocked send has waited at ``now`` (monotonic seconds)."""
        return max((now - t for t in self.blocked.values()), default=0.0)


def check_batch(batch: MessageBatch, max_message_size: int, queue: str) -> None:
    """Refuse, before anything is stored, a batch a client could have forged: a
    message over ``max_message_size`` bytes (body and properties together) or property
    bytes that are not a valid msgpack map (checked once per distinct map)."""
    if not isinstance(batch, MessageBatch):
        raise TypeError(f"send_batch takes a MessageBatch, not {type(batch).__name__}")
    limit, n = max_message_size, len(batch)
    ends = batch.body_offsets + batch.prop_offsets  # where each message's bytes end
    if n <= 0:
        too_big = False
    elif n <= 64 and ends.dtype.kind == "i":  # a single send's gather: Python ints
        # beat NumPy's cost per call (a forged batch of other dtypes takes NumPy's way)
        e = ends.tolist()
        too_big = max(map(int.__sub__, e[1:], e[:-1])) > limit
    else:
        too_big = bool(np.diff(ends).max() > limit)
    if too_big:
        check_sizes(np.diff(ends), limit, queue)
    if len(batch.prop_data):
        groups = batch.property_groups()
        first_of = np.full(len(groups.distinct), len(batch), dtype=np.int64)
        np.minimum.at(first_of, groups.index, np.arange(len(batch)))
        for blob, i in zip(groups.distinct, first_of.tolist(), strict=True):
            check_encoded_properties(blob, where=f"message {i} for queue {queue!r}")


def batch_cost(batch: MessageBatch) -> int:
    """Bytes a batch adds to a queue's size: bodies, properties and per-message
    metadata (offsets and timestamp, 24 bytes a message)."""
    return int(batch.body_offsets[-1] + batch.prop_offsets[-1]) + 24 * len(batch)


__all__ = ["Admission", "batch_cost", "check_batch"]
