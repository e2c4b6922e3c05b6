"""An address's subscriptions over one stored copy: their definitions and ack state.

Artemis stores a message routed to an address with several queues once, and each queue
holds a reference; a page file goes once every queue's page cursor is past it. Here the
address owns one segment log, and each subscription its own acknowledged set
(``AckRanges``: Pulsar's individually deleted ranges). The log's own ack flags are the
*intersection*: an offset is acknowledged in the log once every subscription has
acknowledged it, and a segment (middle ones too) is deleted once all of its offsets are.

Durability: the definitions are in the ``subscriptions`` file (written atomically; see
docs/FORMAT.md, "Subscriptions"); each subscription's acks go to the log's ack log in
the same record as the log's own, tagged with the subscription's id, and the checkpoint
holds every subscription's ranges. Invariant: whatever the log has acknowledged (or
never published, or lost to damage), every subscription has too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import msgpack
import numpy as np

from raymq.errors import StorageError
from raymq.storage.ack_ranges import AckRanges
from raymq.storage.acklog import to_ranges
from raymq.storage.files import write_file_atomic
from raymq.storage.format import DamagedFile, frame, unframe

MANIFEST_NAME = "subscriptions"
MANIFEST_MAGIC = b"RAYMQSUB"
MANIFEST_VERSION = 1
#: Log-unacknowledged offsets examined at a time when recomputing the intersection.
_CHUNK = 65536


@dataclass(frozen=True)
class SubscriptionSpec:
    """One subscription's definition, as the ``subscriptions`` file keeps it."""

    name: str
    #: Tags its acks in the ack log and its ranges in the checkpoint; never reused.
    id: int
    #: Artemis's queue filter: only matching messages are routed to it (None: all).
    filter: str | None
    #: Offsets below this were acknowledged when it was created ("latest").
    start_offset: int
    max_delivery_attempts: int | None = None
    dead_letter_queue: str | None = None


@dataclass
class Manifest:
    """The subscriptions of an address, and the next subscription id."""

    subscriptions: dict[str, SubscriptionSpec]
    next_id: int = 0


def read_manifest(directory: str, queue: str) -> Manifest:
    """The address's subscriptions (none if the file does not exist). Raises
    ``StorageError`` naming the file if it is damaged: which subscriptions exist, and
    so which messages may be deleted, is not guessed."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return Manifest({})
    except OSError as exc:
        raise StorageError(f"address {queue!r}: cannot read {path}: {exc}") from exc
    try:
        doc = msgpack.unpackb(unframe(data, MANIFEST_MAGIC, MANIFEST_VERSION, path))
        specs = [SubscriptionSpec(**s) for s in doc["subscriptions"]]
        return Manifest({s.name: s for s in specs}, doc["next_id"])
    except DamagedFile as exc:
        why = str(exc)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        why = f"{path} is damaged (its body: {type(exc).__name__} {exc})"
    raise StorageError(
        f"address {queue!r}: {why}; its subscriptions are unknown (restore the file, or"
        " remove it to start with none)"
    )


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Replace the ``subscriptions`` file atomically and durably. Raises ``OSError``."""
    body = msgpack.packb(
        {
            "next_id": manifest.next_id,
            "subscriptions": [asdict(s) for s in manifest.subscriptions.values()],
        }
    )
    write_file_atomic(
        os.path.join(directory, MANIFEST_NAME), frame(MANIFEST_MAGIC, MANIFEST_VERSION, body)
    )


class SubscriptionAcks:
    """Every subscription's acknowledged set over one log, and the acks still to log.

    ``log`` is the address's ``SegmentLog``; its writer takes ``take_pending`` with each
    group commit (``SegmentLog.attach_subscriptions``).
    """

    def __init__(self, log, *, retains: bool = False) -> None:
        """``retains``: the address keeps what every subscription acknowledged (its
        retention, ``raymq.storage.retention``): such offsets are ``released``, not
        acknowledged in the log, until the retention lets their segment go."""
        self.log = log
        self.retains = retains
        #: Offsets every subscription acknowledged that the log still keeps (retention).
        self.released = AckRanges()
        self.acked: dict[int, AckRanges] = {}
        self._pending: dict[int, list[np.ndarray]] = {}  # offsets, per subscription id
        self._retry: dict[int, list[np.ndarray]] = {}  # ranges whose write failed

    # -- the writer's side --------------------------------------------------------------

    @property
    def has_pending(self) -> bool:
        """True when acks wait for the next write."""
        return bool(self._pending or self._retry)

    def take_pending(self) -> dict[int, np.ndarray] | None:
        """Each subscription's acks waiting for the log, as [start, end) ranges; they
        are no longer pending."""
        if not self._pending and not self._retry:
            return None
        out: dict[int, np.ndarray] = {}
        for sid in set(self._pending) | set(self._retry):
            parts = list(self._retry.get(sid, ()))
            if sid in self._pending:
                # Each array holds offsets newly acknowledged: disjoint, so sorted
                # already whenever the acks came in order (to_ranges checks).
                parts.append(to_ranges(np.concatenate(self._pending[sid])))
            if sid in self.acked:  # (a deleted subscription's acks are moot)
                out[sid] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self._pending, self._retry = {}, {}
        return out or None

    def requeue(self, ranges: dict[int, np.ndarray]) -> None:
        """Acks whose write failed: they stay applied and go with the next commit."""
        for sid, r in ranges.items():
            self._retry.setdefault(sid, []).append(r)

    def checkpoint_section(self) -> dict[int, bytes]:
        """Every subscription's ranges for the checkpoint, those below the first live
        offset folded into one (they are all acknowledged)."""
        floor = self._live_floor()
        out = {}
        for sid, acked in self.acked.items():
            if floor:
                acked.add_ranges(np.array([[0, floor]], dtype=np.int64))
            out[sid] = acked.to_bytes()
        return out

    # -- subscriptions come and go ------------------------------------------------------

    def load(self, sid: int, ranges: AckRanges | None, start_offset: int) -> None:
        """Take a subscription recovered from the files: its ranges, everything below
        ``start_offset``, and what the log holds acknowledged or never published. One
        of which no ranges were found has its starting set logged with the next commit
        (so that the next recovery finds it)."""
        acked = ranges if ranges is not None else AckRanges()
        if start_offset:
            acked.add_ranges(np.array([[0, start_offset]], dtype=np.int64))
        acked.add_ranges(self._log_acked_ranges())
        self.acked[sid] = acked
        if ranges is None:
            self._retry.setdefault(sid, []).append(acked.ranges().reshape(-1, 2))

    def seek(self, sid: int, offset: int, initial: AckRanges | None = None) -> None:
        """Subscription ``sid`` from ``offset`` on: acknowledged below it (and what the
        log acknowledged), not from it on, retained messages included (those are no
        longer released); or ``initial`` (a ``starting_set(offset)`` its filter routed
        since). The caller makes the new set durable with a checkpoint (an ack record
        can only add; acks not yet written go to the ack log generation before it, which
        the next recovery does not replay)."""
        if initial is None:
            initial = self.starting_set(offset)
        else:
            initial.add_ranges(self._log_acked_ranges())
        self.acked[sid] = initial
        if self.retains:
            self.released = intersection(self.released, initial)

    def starting_set(self, start_offset: int) -> AckRanges:
        """What a subscription created now from ``start_offset`` starts with
        acknowledged: everything below it, and what the log holds acknowledged or never
        published."""
        initial = AckRanges.from_ranges(self._log_acked_ranges())
        if start_offset:
            initial.add_ranges(np.array([[0, start_offset]], dtype=np.int64))
        return initial

    def create(self, sid: int, start_offset: int, initial: AckRanges | None = None) -> None:
        """A new subscription, from ``start_offset`` (0: from the oldest message the
        log still holds), or with ``initial`` (a ``starting_set`` routed since, brought
        up to date here). Its starting set is logged with the next commit."""
        if initial is None:
            initial = self.starting_set(start_offset)
        else:
            initial.add_ranges(self._log_acked_ranges())
        self.acked[sid] = initial
        if self.retains:  # released: what every one acknowledged, this one too
            self.released = intersection(self.released, initial)
        # Logged even if empty: recovery tells a subscription whose starting set is on
        # disk from one created just before a crash (see QueueCore._open_subscriptions).
        self._retry.setdefault(sid, []).append(initial.ranges().reshape(-1, 2))

    def remove(self, sid: int) -> int:
        """Forget a deleted subscription; what every other one has acknowledged is
        acknowledged in the log now. Returns how many offsets that freed."""
        self.acked.pop(sid, None)
        self._pending.pop(sid, None)
        self._retry.pop(sid, None)
        return self.settle()

    def settle(self) -> int:
        """Acknowledge in the log every offset all subscriptions have acknowledged
        (every one, when there are none); returns how many were newly acknowledged."""
        fresh, pos = 0, 0
        while True:
            chunk = self.log.unacked(pos, _CHUNK)
            if not len(chunk):
                return fresh
            pos = int(chunk[-1]) + 1
            for acked in self.acked.values():
                chunk = chunk[acked.contains(chunk)]
            if len(chunk):
                fresh += self.release(chunk)

    # -- acknowledging ------------------------------------------------------------------

    def ack(self, sid: int, offsets: np.ndarray, *, log_it: bool = True) -> np.ndarray:
        """Acknowledge published ``offsets`` for one subscription; those every
        subscription has now acknowledged are acknowledged in the log. Returns the
        offsets newly acknowledged by this subscription."""
        offsets = np.asarray(offsets, dtype=np.int64)
        # Never published: not acknowledged, nor logged (a negative offset would read
        # back as a marker of the ack record's format).
        offsets = offsets[(offsets >= 0) & (offsets < self.log.next_offset)]
        fresh = self.acked[sid].add(offsets)
        if not len(fresh):
            return fresh
        if log_it and self.log.durable:
            self._pending.setdefault(sid, []).append(fresh)
        common = fresh
        for other, acked in self.acked.items():
            if other != sid and len(common):
                common = common[acked.contains(common)]
        if len(common):
            self.release(common)
        return fresh

    def release(self, offsets: np.ndarray) -> int:
        """Every subscription acknowledged ``offsets`` (log-unacknowledged): the log
        acknowledges them, or with retention they are released and kept. Returns how
        many the log acknowledged."""
        if not self.retains:
            return self.log.ack(offsets)
        self.released.add(offsets)
        return 0

    def acked_by_all(self, start: int, end: int) -> bool:
        """True if every offset of [start, end) is acknowledged by every subscription
        (or in the log): no delivery will ask for them."""
        offsets = np.arange(start, end, dtype=np.int64)
        done = self.log.is_acked(offsets)
        if self.retains:
            done |= self.released.contains(offsets)
        return bool(done.all())

    def retained(self) -> tuple[int, int]:
        """Messages every subscription acknowledged that the retention keeps, and their
        bytes (estimated per segment from its size and the share of its messages
        retained, as ``SegmentLog.bytes_queued`` estimates)."""
        messages = nbytes = 0
        if not self.retains:
            return messages, nbytes
        for s in self.log.segments:
            kept = self.released.count_in(s.base_offset, s.end_offset)
            messages += kept
            if kept and s.fd is not None:
                nbytes += (s.size - s.header_size) * kept // s.count
        return messages, nbytes

    def ack_everywhere(self, offsets: np.ndarray) -> None:
        """Acknowledge ``offsets`` for every subscription (messages lost to damage, or
        routed to none): the log acknowledges them too."""
        offsets = np.asarray(offsets, dtype=np.int64)
        for acked in self.acked.values():
            acked.add(offsets[offsets < self.log.next_offset])
        self.log.ack(offsets)

    def depth(self, sid: int) -> int:
        """Published messages this subscription has not acknowledged."""
        acked = self.acked[sid]
        return sum(s.count - acked.count_in(s.base_offset, s.end_offset) for s in self.log.segments)

    # -- helpers ------------------------------------------------------------------------

    def _live_floor(self) -> int:
        segments = self.log.segments
        return segments[0].base_offset if len(segments) else self.log.next_offset

    def _log_acked_ranges(self) -> np.ndarray:
        """Offsets the log holds acknowledged, or that no live segment holds, below its
        next offset, as [start, end) ranges."""
        return np.concatenate(list(_log_acked_parts(self.log)) or [np.zeros((0, 2), np.int64)])


def intersection(a: AckRanges, b: AckRanges) -> AckRanges:
    """The offsets in both ``a`` and ``b`` (a walk over their intervals)."""
    ra, rb = a.ranges(), b.ranges()
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(ra) and j < len(rb):
        start, end = max(ra[i][0], rb[j][0]), min(ra[i][1], rb[j][1])
        if start < end:
            out.append((int(start), int(end)))
        if ra[i][1] < rb[j][1]:
            i += 1
        else:
            j += 1
    return AckRanges.from_ranges(np.array(out, dtype=np.int64).reshape(-1, 2))


def _log_acked_parts(log) -> Iterator[np.ndarray]:
    pos = 0
    for seg in log.segments:
        if seg.base_offset > pos:
            yield np.array([[pos, seg.base_offset]], dtype=np.int64)
        if seg.acked_n:
            flags = seg.acked[: seg.count]
            yield to_ranges(np.flatnonzero(flags) + seg.base_offset)
        pos = seg.end_offset
    if log.next_offset > pos:
        yield np.array([[pos, log.next_offset]], dtype=np.int64)


class SubscriptionLog:
    """One subscription's view of the address's log, with the calls a ``TargetArea``
    makes: reads and the index go to the log, acks and unacked offsets to the
    subscription's set."""

    def __init__(self, log, acks: SubscriptionAcks, sid: int):
        self._log = log
        self._acks = acks
        self.sid = sid

    @property
    def next_offset(self) -> int:
        """One past the last published offset."""
        return self._log.next_offset

    @property
    def segments(self):
        """The address's live segments."""
        return self._log.segments

    @property
    def depth(self) -> int:
        """Published messages this subscription has not acknowledged."""
        return self._acks.depth(self.sid)

    def segment_of(self, offset: int):
        """The live segment holding ``offset``, if any."""
        return self._log.segment_of(offset)

    def read(self, start: int, end: int, *, cache: bool = True):
        """Messages of offsets [start, end), as the log reads them."""
        return self._log.read(start, end, cache=cache)

    def properties(self, start: int, end: int):
        """Timestamps and properties of offsets [start, end)."""
        return self._log.properties(start, end)

    def confirm(self, offsets: np.ndarray) -> np.ndarray:
        """Which of sorted ``offsets`` pass their records' checks, as the log checks."""
        return self._log.confirm(offsets)

    def is_acked(self, offsets: np.ndarray) -> np.ndarray:
        """Ack flag per offset for this subscription. The log's flags too: what it
        acknowledged but the subscription does not know yet (a record a read found
        damaged, until the queue drains it; offsets never published, e.g. burned) is
        acknowledged here as well."""
        offsets = np.asarray(offsets, dtype=np.int64)
        return self._acks.acked[self.sid].contains(offsets) | self._log.is_acked(offsets)

    def ack(self, offsets: np.ndarray, *, log_it: bool = True) -> int:
        """Acknowledge for this subscription; returns how many were newly acked."""
        return len(self._acks.ack(self.sid, offsets, log_it=log_it))

    def unacked(self, start: int, limit: int, end: int | None = None) -> np.ndarray:
        """Up to ``limit`` offsets >= ``start`` (and < ``end``) published and not
        acknowledged by this subscription."""
        acked = self._acks.acked[self.sid]
        stop = self.next_offset if end is None else min(end, self.next_offset)
        out, need, pos = [], limit, max(start, 0)
        while need > 0 and pos < stop:
            got = acked.gaps(pos, stop, need)
            if not len(got):
                break
            pos = int(got[-1]) + 1
            gone = self._log.is_acked(got)
            if gone.any():  # never published, or lost: acknowledged here too
                acked.add(got[gone])
                got = got[~gone]
            out.append(got)
            need -= len(got)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
