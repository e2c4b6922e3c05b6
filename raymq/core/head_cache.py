"""HeadQueueCache: a memory-bounded window of undelivered messages, shared by every
subscription of a queue or address.

As in the ActiveMQ design it serves consumers arriving at a deep queue (and steady
dispatch, when consumers keep up) without reading the QueueArea. It covers one
contiguous offset range; when full, newer batches are not added and a refill from the
log extends it once room returns.

An address has one for all its subscriptions (one copy in memory, as on disk). Which
range it keeps follows the *leading* subscriptions: those whose undelivered head is
within the cache's size of the most advanced head. A subscription further behind (a
stopped or slow one) reads pages and does not hold the window back, so the ones that
keep up stay in memory; this is where RayMQ does better than Artemis, where one lazy
subscription makes the whole address page. A queue has one subscription, so its
window simply starts at its head.

Each cached batch is converted to Arrow and shared once, on its first delivery
(``share``: the shell's ``ray.put``): every later delivery of its messages, to any
subscription, is a reference to that one object rather than a new copy.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

import pyarrow as pa

from raymq.batch import MessageBatch

#: Most messages one refill read asks the log for.
REFILL_STEP_MESSAGES = 4096
#: Most bytes a housekeeping refill reads in one go (about 10 ms of reading and
#: decoding here): the event loop serves fetches in between, so a large budget arriving
#: (a restart, say) never holds a first consumer up for long; the next call goes on.
REFILL_STEP_BYTES = 4 * 2**20


class CachedBatch:
    """One cached batch and, once delivered, its shared Arrow form."""

    __slots__ = ("batch", "arrow", "ref")

    def __init__(self, batch: MessageBatch):
        self.batch = batch
        self.arrow: pa.RecordBatch | None = None
        self.ref: object = None


class SharedPart:
    """Rows ``first_row:first_row + rows`` of a cached batch's shared Arrow object."""

    __slots__ = ("ref", "arrow", "first_row", "rows", "nbytes", "end")

    def __init__(
        self, ref: object, arrow: pa.RecordBatch, first_row: int, rows: int, nbytes: int, end: int
    ):
        self.ref = ref
        self.arrow = arrow
        self.first_row = first_row
        self.rows = rows
        self.nbytes = nbytes  # approximate: the whole batch's, pro rata
        self.end = end  # one past the last offset of its rows


def _identity(batch: pa.RecordBatch) -> object:
    return batch


class HeadQueueCache:
    """Contiguous batches [start, end) of the log, at most ``max_bytes``."""

    def __init__(self, max_bytes: int, share: Callable[[pa.RecordBatch], object] | None = None):
        """``share`` turns a batch's Arrow form into what deliveries carry (a Ray
        object reference in the actor; the batch itself without Ray)."""
        self.max_bytes = max_bytes
        self.share = share or _identity
        # Parallel lists from index ``_lo`` on (front pops move ``_lo``; compacted now
        # and then): bisecting ``_firsts`` finds a range in O(log n) however small the
        # batches (single sends make many).
        self._chunks: list[CachedBatch] = []
        self._firsts: list[int] = []
        self._lo = 0
        self.bytes = 0
        self.messages = 0
        #: True when batches after ``end`` exist in the log but are not cached.
        self.behind = False
        self.shared_batches = 0  # batches converted and shared (one copy each)
        self._offered_bytes = 0.0  # running average size of a message offered (bytes)

    # -- range ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._chunks) - self._lo

    @property
    def start(self) -> int:
        """First cached offset (-1 when empty)."""
        return self._firsts[self._lo] if len(self) else -1

    @property
    def end(self) -> int:
        """One past the last cached offset (-1 when empty)."""
        return self._chunks[-1].batch.end_offset if len(self) else -1

    def covers(self, start: int, end: int) -> bool:
        """True if every offset of [start, end) is cached."""
        return len(self) > 0 and self.start <= start and end <= self.end

    # -- filling -------------------------------------------------------------------------

    def append(self, batch: MessageBatch, window_start: int | None = None) -> bool:
        """Cache a newly published batch if it continues the range and fits.

        An empty cache that fell behind starts again with it only if ``window_start``
        (where the window starts now, when the caller knows) is this batch's offset:
        else what lies between is the refill's to read first.
        """
        if len(batch):
            size, m = batch.nbytes / len(batch), self._offered_bytes
            self._offered_bytes = size if not m else 0.9 * m + 0.1 * size
        if len(self):
            continues = batch.first_offset == self.end
        else:
            continues = not self.behind or window_start == batch.first_offset
        if not continues or self.bytes + batch.nbytes > self.max_bytes:
            self.behind = True
            return False
        self._push(batch)
        self.behind = False  # it is the log's newest batch
        return True

    def _push(self, batch: MessageBatch) -> None:
        self._chunks.append(CachedBatch(batch))
        self._firsts.append(batch.first_offset)
        self.bytes += batch.nbytes
        self.messages += len(batch)

    def _pop_front(self) -> None:
        chunk = self._chunks[self._lo]
        self._chunks[self._lo] = None  # type: ignore[call-overload]  # drop the reference now
        self._lo += 1
        self.bytes -= chunk.batch.nbytes
        self.messages -= len(chunk.batch)
        if self._lo > 64 and self._lo * 2 > len(self._chunks):
            del self._chunks[: self._lo], self._firsts[: self._lo]
            self._lo = 0

    def _pop_back(self) -> None:
        chunk = self._chunks.pop()
        self._firsts.pop()
        self.bytes -= chunk.batch.nbytes
        self.messages -= len(chunk.batch)
        if not len(self):
            self._chunks, self._firsts, self._lo = [], [], 0

    @property
    def message_bytes(self) -> float:
        """Size of a message (bytes): the cached ones' average, else that of the
        messages offered lately (1 KiB before any)."""
        if self.messages:
            return self.bytes / self.messages
        return self._offered_bytes or 1024.0

    def window_start(
        self, heads: Iterable[int], message_bytes: float | None = None, newest: int | None = None
    ) -> int | None:
        """Where the window should start: the lowest head within the cache's size
        (``max_bytes`` over ``message_bytes`` per message) of the most advanced one,
        or of ``newest`` (one past a batch to add) when that one is itself within
        reach of it (the leaders keep up); None when no head is given."""
        heads = sorted(heads)
        if not heads:
            return None
        reach = self.max_bytes / max(message_bytes or self.message_bytes, 1.0)
        lead = heads[-1]
        if newest is not None and newest - lead <= reach:
            lead = newest
        return next((h for h in heads if lead - h <= reach), lead)

    def trim(self, head: int) -> None:
        """Drop batches wholly below ``head`` (delivered, or left to the log for the
        subscriptions behind the window)."""
        while len(self) and self._chunks[self._lo].batch.end_offset <= head:
            self._pop_front()

    def resize(self, max_bytes: int) -> None:
        """Change the budget (bytes); evicts the newest batches until it fits."""
        self.max_bytes = max_bytes
        while len(self) and self.bytes > max_bytes:
            self._pop_back()
            self.behind = True

    def refill(
        self,
        read: Callable[[int, int], list[MessageBatch]],
        head: int,
        log_end: int,
        until: int | None = None,
        gap_ok: Callable[[int, int], bool] | None = None,
        step_bytes: int | None = None,
    ) -> None:
        """Extend the cache with ``read(start, end)`` batches from the log while it has room.

        ``head`` is where the cache should start when empty; ``log_end`` the log's end;
        ``until``: stop once offsets below it are cached (a delivery's need), not at
        the budget. Each read asks for about as many messages as there is room for
        (``message_bytes`` each), so what does not fit is hardly read. A gap in what
        the log returns (a deleted segment, a damaged record) is stepped over when
        ``gap_ok(start, end)`` says nobody will ask for those offsets; else the
        refill stops there. ``step_bytes``: stop once about that many bytes were added
        (the cache stays ``behind``: a later call goes on); None: no such bound.
        """
        if not len(self):
            self.behind = head < log_end
            pos = head
        else:
            pos = self.end
        stop = log_end if until is None else min(until, log_end)
        per_message = max(self.message_bytes, 1.0)
        limit = (
            self.max_bytes if step_bytes is None else min(self.max_bytes, self.bytes + step_bytes)
        )
        while self.behind and pos < stop and limit - self.bytes >= per_message:
            room = int((limit - self.bytes) / per_message)
            chunk_end = min(log_end, pos + max(1, min(REFILL_STEP_MESSAGES, room)))
            for b in read(pos, chunk_end):
                if self.bytes + b.nbytes > self.max_bytes:
                    return
                gap = bool(len(self)) and b.first_offset != self.end
                if gap and (gap_ok is None or not gap_ok(self.end, b.first_offset)):
                    return  # a gap someone may still ask for: the cache ends here
                self._push(b)
            pos = chunk_end
        if pos >= log_end:
            self.behind = False

    # -- reading -------------------------------------------------------------------------

    def _index(self, offset: int) -> int:
        return bisect.bisect_right(self._firsts, offset, self._lo) - 1

    def get(self, start: int, end: int) -> list[MessageBatch] | None:
        """Batches covering exactly [start, end) if all cached, else None."""
        if not self.covers(start, end):
            return None
        out = []
        for k in range(self._index(start), len(self._chunks)):
            b = self._chunks[k].batch
            if b.first_offset >= end:
                break
            lo, hi = max(start, b.first_offset), min(end, b.end_offset)
            if hi > lo:  # (``start`` may lie in a gap stepped over)
                out.append(b.slice(lo - b.first_offset, hi - b.first_offset))
        return out

    def shared(self, start: int, end: int, min_rows: int = 1) -> list[SharedPart] | None:
        """[start, end) as parts of shared Arrow objects (each batch converted and
        shared once, on its first delivery), or None if not all cached (a gap stepped
        over inside included), or if the parts would be fewer than ``min_rows`` rows
        each on average (many small batches: one batch made for the delivery costs
        less)."""
        if not self.covers(start, end):
            return None
        first = self._index(start)
        parts = self._index(end - 1) - first + 1
        if parts > 1 and (end - start) < min_rows * parts:
            return None
        out = []
        for k in range(first, len(self._chunks)):
            chunk = self._chunks[k]
            b = chunk.batch
            if b.first_offset >= end:
                break
            if b.end_offset <= start:
                continue
            if max(start, b.first_offset) != (out[-1].end if out else start):
                return None  # a gap stepped over lies inside: not one run of rows
            if chunk.ref is None:
                chunk.arrow = b.to_arrow()
                chunk.ref = self.share(chunk.arrow)
                self.shared_batches += 1
            lo, hi = max(start, b.first_offset), min(end, b.end_offset)
            nbytes = b.nbytes * (hi - lo) // len(b)
            out.append(SharedPart(chunk.ref, chunk.arrow, lo - b.first_offset, hi - lo, nbytes, hi))
        return out
