"""Producer deduplication: the ids of messages stored lately, and what each send answers.

Artemis's duplicate detection: a producer may give a message an id (Artemis's
``_AMQ_DUPL_ID`` property, the same name here); a message whose id the queue stored
within ``dedup_window_s`` seconds is not stored again, and its send answers with the
first one's offset. So a producer that resends after a lost answer, or a Ray Data write
task that Ray retries, stores each message once.

The id travels as the message's ``_AMQ_DUPL_ID`` property, so it is durable with the
message itself (one record, one CRC); the table here is rebuilt from the stored
messages and the checkpoint after a restart (``raymq.storage.duplicate_ids``). It holds
at most ``id_cache_size`` ids (Artemis's name), the oldest forgotten first, and none
older than the window. Ray-free: the clock is injected.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from raymq.errors import InvalidSetting

# Spelled once, in raymq.properties, which storage may import too.
from raymq.properties import DUPLICATE_ID_PROPERTY

#: Longest id, in UTF-8 bytes: ids are kept in memory and in every checkpoint.
MAX_ID_BYTES = 256


def check_message_ids(ids: Sequence[object], n: int, queue: str) -> list[str | None]:
    """``ids`` checked against ``n`` messages: each a non-empty str of at most
    ``MAX_ID_BYTES`` bytes, or None (that message has no id). ``InvalidSetting``
    naming the queue otherwise."""
    if isinstance(ids, str | bytes) or len(ids) != n:
        raise InvalidSetting(
            f"message_ids for queue {queue!r} must be a sequence of one id per message"
            f" ({n}), not {type(ids).__name__}"
            + ("" if isinstance(ids, str | bytes) else f" of {len(ids)}")
        )
    out: list[str | None] = []
    for mid in ids:
        if mid is not None:
            check_message_id(mid, queue)
        out.append(mid)  # type: ignore[arg-type]
    return out


def check_message_id(mid: object, queue: str) -> str:
    """One id checked (see ``check_message_ids``)."""
    if not isinstance(mid, str) or not mid:
        raise InvalidSetting(f"message_id for queue {queue!r} must be a non-empty str, not {mid!r}")
    if len(mid.encode()) > MAX_ID_BYTES:
        raise InvalidSetting(
            f"message_id for queue {queue!r} is {len(mid.encode())} bytes, above {MAX_ID_BYTES}"
        )
    return mid


def with_message_ids(bodies: Any, properties: Any, ids: list[str | None]) -> tuple[Any, Any]:
    """``send_batch``'s (bodies, properties) with each id stamped into its message's
    ``_AMQ_DUPL_ID`` property: a column of an Arrow table, else a key of each message's
    properties (``properties``: None, one mapping for all, or one per message)."""
    if isinstance(bodies, pa.Table | pa.RecordBatch):
        column = pa.array(ids, pa.string())
        if DUPLICATE_ID_PROPERTY in bodies.schema.names:
            bodies = bodies.drop_columns([DUPLICATE_ID_PROPERTY])
        return bodies.append_column(DUPLICATE_ID_PROPERTY, column), properties
    if properties is None or isinstance(properties, Mapping):
        rows: Sequence[Mapping | None] = [properties] * len(ids)
    else:
        rows = properties
    stamped = [
        dict(p or {}) if mid is None else {**(p or {}), DUPLICATE_ID_PROPERTY: mid}
        for p, mid in zip(rows, ids, strict=False)
    ]
    return bodies, [p or None for p in stamped]


@dataclass(frozen=True)
class IdEntry:
    """A remembered id: the offset its message was stored at, and when (seconds since
    the epoch, the queue's clock)."""

    offset: int
    stored_at: float


class DuplicateIDCache:
    """The ids stored within the last ``window_s`` seconds, at most ``max_ids`` of them."""

    def __init__(
        self, window_s: float, max_ids: int, clock: Callable[[], float] = time.time
    ) -> None:
        self.window_s = window_s
        self.max_ids = max_ids
        self.clock = clock
        #: id -> entry, oldest first (stored order).
        self._ids: OrderedDict[str, IdEntry] = OrderedDict()
        #: Sends answered with an earlier message's offset instead of being stored.
        self.duplicates_dropped = 0
        #: Sends with ids being stored: the next offset to give when each began (its
        #: messages' offsets are at least that), by token.
        self._storing: dict[object, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def enabled(self) -> bool:
        """False when the queue's window is 0: ids are stored, never looked up."""
        return self.window_s > 0 and self.max_ids > 0

    def lookup(self, mid: str) -> int | None:
        """The offset of the message stored under ``mid`` within the window, if any."""
        self.prune()
        entry = self._ids.get(mid)
        return None if entry is None else entry.offset

    def remember(self, mid: str, offset: int, stored_at: float | None = None) -> None:
        """``mid`` was stored at ``offset`` (``stored_at``: now unless given)."""
        if not self.enabled:
            return
        when = self.clock() if stored_at is None else stored_at
        if mid in self._ids:  # a restore meets ids it has (checkpoint and segments)
            if self._ids[mid].offset <= offset:
                return
            del self._ids[mid]
        self._ids[mid] = IdEntry(offset, when)
        while len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)

    def restore(self, entries: Iterable[tuple[str, int, float]]) -> int:
        """Remember (id, offset, stored_at) triples found after a restart, in any order;
        those outside the window are skipped. Returns how many were kept."""
        cutoff = self.clock() - self.window_s
        fresh = sorted((e for e in entries if e[2] >= cutoff), key=lambda e: (e[2], e[1]))
        for mid, offset, when in fresh:
            self.remember(mid, offset, when)
        self.prune()
        return len(self._ids)

    def prune(self) -> None:
        """Forget ids stored longer than the window ago."""
        cutoff = self.clock() - self.window_s
        ids = self._ids
        while ids:
            mid, entry = next(iter(ids.items()))
            if entry.stored_at >= cutoff:
                break
            del ids[mid]

    def storing(self, next_offset: int) -> object:
        """A send with ids begins, its messages to be stored at ``next_offset`` or
        later; returns its token for ``stored``."""
        token = object()
        self._storing[token] = next_offset
        return token

    def stored(self, token: object) -> None:
        """The send of ``token`` ended (its ids remembered, or it failed)."""
        self._storing.pop(token, None)

    def cover(self, planned_next: int) -> int | None:
        """An offset below which every stored message's id is remembered here: the
        oldest send still storing ids bounds it, else ``planned_next`` (the next offset
        the log will give). None when there are no ids at all."""
        if not self._ids and not self._storing:
            return None
        return min([planned_next, *self._storing.values()])

    def entries(self) -> list[tuple[str, int, float]]:
        """Every remembered (id, offset, stored_at), oldest first (for the checkpoint)."""
        self.prune()
        return [(mid, e.offset, e.stored_at) for mid, e in self._ids.items()]
