"""SegmentLog: the QueueArea of one queue, composed of the storage engine's parts.

Each concept has one owner (Kafka's log layer is the model):

- ``loader.Loader``: recovery and its ``RecoveryReport``;
- ``checkpoint``: the checkpoint file;
- ``writer.Writer``: group commits (records, acks, checkpoints), segment deletion;
- ``read_cache.ReadCache`` and ``reader.Reader``: reading messages back;
- ``ack_state.AckState``: ack flags, depth, acks waiting for the ack log;
- ``segment.Segment``/``Segments``: one page file's index, the live segments;
- ``flow.Flow``: transient messages flowing to disk.

This class only composes them and keeps the API the queue core uses. Writes happen in
three steps so that an async actor can keep serving while the disk works: ``prepare``
(event loop), ``write`` (worker thread, file descriptors only), ``publish`` (event loop);
only one write may be in flight at a time. Everything else runs in the event loop.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np

from raymq.batch import MessageBatch
from raymq.errors import StorageError
from raymq.storage.ack_state import AckState
from raymq.storage.acklog import to_ranges
from raymq.storage.damage import Quarantine
from raymq.storage.files import create_queue_directory, storage_error
from raymq.storage.flow import Flow
from raymq.storage.loader import Loader, RecoveryReport, remove_transient_files
from raymq.storage.lock import DirectoryLock
from raymq.storage.read_cache import ReadCache
from raymq.storage.reader import Reader
from raymq.storage.scrub import Scrubber
from raymq.storage.segment import Segment, Segments
from raymq.storage.subscriptions import MANIFEST_NAME, Manifest, SubscriptionAcks, read_manifest
from raymq.storage.writer import PreparedWrite, RememberedIds, Writer

log = logging.getLogger("raymq.storage")


class SegmentLog:
    """The queue's messages: page files (or memory, for a non-durable queue) and ack state."""

    def __init__(
        self,
        directory: str,
        *,
        queue: str,
        page_size_bytes: int,
        durable: bool = True,
        read_cache_bytes: int = 64 * 2**20,
    ):
        self.directory = directory
        self.queue = queue
        self.page_size_bytes = page_size_bytes
        self.durable = durable
        self.segments = Segments()
        self._acks = AckState(self.segments, durable=durable)
        self._cache = ReadCache(read_cache_bytes)
        self._quarantine = Quarantine(queue, self._acks)
        self._reader = Reader(queue, self.segments, self._cache, self._quarantine)
        self._scrubber = Scrubber(queue, self.segments, self._quarantine)
        self._flow = Flow(directory, queue, self.segments)
        self._writer = Writer(
            directory,
            queue=queue,
            page_size_bytes=page_size_bytes,
            durable=durable,
            segments=self.segments,
            acks=self._acks,
            cache=self._cache,
            flow=self._flow,
        )
        self._recovered_lost = 0
        #: From recovery, for an address: its subscriptions' ranges (``Loader``), and
        #: where its filters must be applied again.
        self.recovered_subscriptions: dict | None = None
        #: The producer ids recovery found: the checkpoint's (see
        #: ``checkpoint_duplicate_ids``) and the live segments' (``open``'s ``ids_since_us``).
        self.recovered_duplicate_ids: list[tuple[str, int, float]] = []
        #: offset -> due (µs since the epoch) of messages recovery found waiting out a
        #: nack's delay (see ``delay``).
        self.recovered_delays: dict[int, int] = {}
        #: offset -> deliveries so far, of unacknowledged messages delivered before.
        self.recovered_deliveries: dict[int, int] = {}
        self.route_from = 0
        #: An address's ``subscriptions`` file, read before recovery changes anything
        #: (None: there is none, or the queue is not durable).
        self.manifest: Manifest | None = None
        #: The directory's LOCK, held while open (``open`` takes it, ``close`` drops it).
        self._lock: DirectoryLock | None = None

    # -- opening ---------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str,
        *,
        queue: str,
        page_size_bytes: int,
        durable: bool = True,
        read_cache_bytes: int = 64 * 2**20,
        ids_since_us: int | None = None,
    ) -> tuple[SegmentLog, RecoveryReport]:
        """Open (creating if needed) the queue's directory and recover its state.

        A non-durable queue starts empty and keeps its messages in memory. An address
        (a directory with a ``subscriptions`` file) has that file read first, so that a
        damaged one (``StorageError``) stops the open before anything changes; and as it
        may still fail to open after recovery (while its subscriptions are settled),
        what would hide the damage recovery found from the next one is left to the
        log's first checkpoint (docs/FORMAT.md, "Recovery", step 6). Recovery reads
        the producer ids stored since ``ids_since_us`` (µs since the epoch; None: none)
        into ``recovered_duplicate_ids``.
        """
        t0 = time.perf_counter()
        try:
            create_queue_directory(directory)
        except OSError as exc:
            raise storage_error(queue, "creating the queue directory", directory, exc) from exc
        self = cls(
            directory,
            queue=queue,
            page_size_bytes=page_size_bytes,
            durable=durable,
            read_cache_bytes=read_cache_bytes,
        )
        self._lock = DirectoryLock.acquire(directory, queue)  # one writer per directory
        report = RecoveryReport(queue=queue)
        self._recover_or_close(report, ids_since_us)
        self._recovered_lost = report.lost_messages
        report.segments = len(self.segments)
        report.depth = self.depth
        report.next_offset = self.next_offset
        report.seconds = time.perf_counter() - t0
        for line in report.damage:
            log.warning("queue %r: %s", queue, line)
        return self, report

    def _recover_or_close(self, report: RecoveryReport, ids_since_us: int | None) -> None:
        """Recover a durable queue's state from its directory into this log (what was
        found goes to ``report``), or remove a non-durable queue's leftover files.

        On failure the log is closed first (its files and LOCK let go): an ``OSError``
        becomes a ``StorageError`` naming the queue and the file (the damage found so
        far is logged: the next recovery finds it again, it is not lost); anything else
        (a bug) is raised as it is.
        """
        try:
            if self.durable:
                self._recover(report, ids_since_us)
            else:
                remove_transient_files(self.directory)
        except OSError as exc:
            self.close()
            for line in report.damage:  # found again by the next recovery, not lost
                log.warning("queue %r: recovery failed, having found: %s", self.queue, line)
            if isinstance(exc, StorageError):
                raise
            path = exc.filename if isinstance(exc.filename, str) else self.directory
            raise storage_error(self.queue, "recovery", path, exc) from exc
        except BaseException:  # a bug: raised as it is, the files and LOCK let go first
            self.close()
            raise

    def _recover(self, report: RecoveryReport, ids_since_us: int | None) -> None:
        """Read an address's ``subscriptions`` file (before anything changes), run the
        ``Loader`` and set the writer and the address's state from what it recovered."""
        if os.path.exists(os.path.join(self.directory, MANIFEST_NAME)):
            self.manifest = read_manifest(self.directory, self.queue)
        loader = Loader(self.directory, self.segments, self._acks, report)
        got = loader.recover(defer=self.manifest is not None, ids_since_us=ids_since_us)
        self._writer.resume(got.next_offset, got.ack_log, got.ack_generation, got.undeleted)
        self._writer.deferred = got.deferred
        self.recovered_subscriptions = got.subscription_ranges
        self.recovered_duplicate_ids = [*got.duplicate_ids, *got.stored_ids]
        self.recovered_delays = got.delays
        self.recovered_deliveries = got.deliveries
        self.route_from = got.route_from

    # -- writing (see Writer) ---------------------------------------------------------

    def prepare(
        self,
        batches: list[MessageBatch],
        now_us: int,
        *,
        checkpoint: bool = False,
        counts: bool = True,
    ) -> PreparedWrite:
        """Plan one group commit of ``batches``, pending acks and maybe a checkpoint
        (event loop). Assigns offsets and timestamps (``now_us``, microseconds);
        ``counts`` False lets delivery counts wait (see ``Writer.prepare``)."""
        return self._writer.prepare(batches, now_us, checkpoint=checkpoint, counts=counts)

    def write(self, prepared: PreparedWrite) -> None:
        """The I/O of a prepared write (a worker thread may run it)."""
        self._writer.write(prepared)

    def publish(self, prepared: PreparedWrite) -> None:
        """Make written records readable; delete fully acknowledged segments."""
        self._writer.publish(prepared)

    def abort(self, prepared: PreparedWrite) -> None:
        """Forget a prepared write whose I/O failed."""
        self._writer.abort(prepared)

    def keep_deleted_names(self) -> None:
        """Keep the names of deleted segment files for ``take_deleted_names`` (a
        replicated queue's leader tells its followers)."""
        self._writer.deleted_names = []

    def take_deleted_names(self) -> list[str]:
        """Names of segment files deleted since the last call."""
        names = self._writer.deleted_names or []
        if self._writer.deleted_names:
            self._writer.deleted_names = []
        return names

    def published_sizes(self) -> dict[str, int]:
        """Published bytes of each segment file, by file name."""
        return {os.path.basename(s.path): s.size for s in self.segments if s.path}

    @property
    def records_end(self) -> int:
        """One past the last published record's last offset (the next offset if there
        is no segment)."""
        return self.segments[-1].end_offset if len(self.segments) else self.next_offset

    @property
    def planned_next(self) -> int:
        """The next offset once the write in flight (if any) is published."""
        return self._writer.planned_next

    def unlink_deleted(self) -> None:
        """Unlink the files of segments deleted since the last call (off the event loop)."""
        self._writer.unlink_deleted()

    # -- acknowledging (see AckState) -------------------------------------------------

    def ack(self, offsets: np.ndarray, *, log_it: bool = True) -> int:
        """Mark published offsets acknowledged; returns how many were newly acked. The
        acks reach the ack log with the next group commit."""
        return self._acks.ack(offsets, log_it=log_it)

    def is_acked(self, offsets: np.ndarray) -> np.ndarray:
        """Ack flag per offset (offsets of deleted segments count as acked)."""
        return self._acks.is_acked(offsets)

    def unacked(self, start: int, limit: int, end: int | None = None) -> np.ndarray:
        """Up to ``limit`` unacknowledged published offsets >= ``start`` (and < ``end``)."""
        end = self._writer.next_offset if end is None else min(end, self._writer.next_offset)
        return self._acks.unacked(start, limit, end)

    # -- reading (see Reader) -----------------------------------------------------------

    def read(self, start: int, end: int, *, cache: bool = True) -> list[MessageBatch]:
        """Messages of offsets [start, end) as batches in offset order (gaps skipped);
        ``cache`` False leaves the read cache unfilled (see ``Reader.read``)."""
        return self._reader.read(start, end, cache=cache)

    def properties(self, start: int, end: int) -> list[MessageBatch]:
        """Like ``read`` but with empty bodies: timestamps and properties only."""
        return self._reader.properties(start, end)

    def confirm(self, offsets: np.ndarray) -> np.ndarray:
        """Which of sorted ``offsets`` pass their records' checks (see
        ``Reader.confirm``): before acting on properties read unchecked."""
        return self._reader.confirm(offsets)

    def segment_of(self, offset: int) -> Segment | None:
        """The live segment holding ``offset``, if any."""
        return self.segments.holding(offset)

    def set_read_cache_bytes(self, limit: int) -> None:
        """Change the read cache's size (bytes), evicting the least recently used."""
        self._cache.resize(limit)

    def flow_to_disk(self, limit: int) -> int:
        """Write transient records to disk, newest first, until at most ``limit`` bytes
        of them stay in memory; returns how many messages flowed."""
        return self._flow.flow_to_disk(limit)

    # -- damage (see Quarantine, Scrubber) ---------------------------------------------

    @property
    def damaged_messages(self) -> int:
        """Messages lost to damage: found by recovery (still in live segments, or in
        files moved aside) and found since, by reads and the scrub."""
        return self._recovered_lost + self._quarantine.damaged_messages

    def found_damaged(self) -> np.ndarray:
        """``drain_damaged``'s offsets so far, without taking them (sorted)."""
        return self._quarantine.found()

    def drain_damaged(self) -> np.ndarray:
        """Offsets taken out of delivery as damaged since the last call (sorted). The
        queue must release them from whoever holds them: they will never be received,
        and are acknowledged already (``is_acked`` is True)."""
        return self._quarantine.drain()

    def scrub_step(self, max_bytes: int) -> int:
        """Check the CRCs of stored records (unacknowledged ones, on disk) for about
        ``max_bytes`` bytes from where the last call stopped, round and round; returns
        the bytes read (0: nothing to check). Damaged records are quarantined as by a
        read (``drain_damaged``). Call from the event loop: it reads at most
        ``max_bytes`` or one record. Raises ``StorageError`` if a file cannot be read."""
        return self._scrubber.step(max_bytes)

    @property
    def scrubbed_bytes(self) -> int:
        """Bytes the scrub has checked since the log was opened."""
        return self._scrubber.bytes_checked

    @property
    def scrub_passes(self) -> int:
        """Complete scrub passes over every segment since the log was opened."""
        return self._scrubber.passes

    @property
    def storage_errors(self) -> int:
        """Write, repair, checkpoint and unlink failures since the log was opened (each
        was logged with its queue, file and errno)."""
        return self._writer.storage_errors

    @property
    def checkpoint_failures(self) -> int:
        """Checkpoints that failed (tried again with a later commit)."""
        return self._writer.checkpoint_failures

    @property
    def last_storage_error(self) -> StorageError | None:
        """The latest of ``storage_errors``, if any."""
        return self._writer.last_error

    @property
    def writable(self) -> bool:
        """False while a failed write is not yet cut back: records are refused (acks
        are not); every ``prepare`` tries again."""
        return self._writer.writable

    # -- state -----------------------------------------------------------------------

    @property
    def next_offset(self) -> int:
        """One past the last published offset."""
        return self._writer.next_offset

    @property
    def depth(self) -> int:
        """Published, unacknowledged messages."""
        return self._acks.depth

    @property
    def has_pending_acks(self) -> bool:
        """True when acks wait for the next write (the subscriptions' too), or the
        checkpoint recovery left to it (``Writer.deferred``)."""
        subs = self._writer.subscriptions
        return (
            self._acks.has_pending
            or (subs is not None and subs.has_pending)
            or self._writer.deferred is not None
            or bool(self._writer.pending_delays)
            or bool(self._writer.pending_deliveries)
        )

    def attach_subscriptions(self, subscriptions: SubscriptionAcks) -> None:
        """An address's subscriptions: their acks go to the ack log with each commit,
        their ranges into each checkpoint."""
        self._writer.subscriptions = subscriptions

    def delay(self, offsets: np.ndarray, due_us: int) -> None:
        """Offsets nacked with a delay, not to be delivered before ``due_us`` (µs since
        the epoch): written to the ack log with the next commit (``flush`` awaits it),
        found again by recovery (``recovered_delays``)."""
        if self.durable and len(offsets):
            self._writer.pending_delays.append((due_us, to_ranges(np.sort(offsets))))

    def checkpoint_delays(self, delayed: Callable[[], list[tuple[int, int]]] | None) -> None:
        """Every checkpoint from now on carries ``delayed()``: (offset, due µs) of each
        message still waiting out a nack's delay."""
        self._writer.delayed = delayed

    def record_deliveries(self, offsets: np.ndarray | list[int], count: int) -> None:
        """``offsets`` (sorted, unique) have been delivered ``count`` times so far:
        written to the ack log with the next commit, found again by recovery
        (``recovered_deliveries``). A run of the same count joins the last one."""
        n = len(offsets)
        if not self.durable or not n:
            return
        first, last = int(offsets[0]), int(offsets[-1])
        # Takes from the shared cursor are one run each, and follow each other.
        if last - first + 1 == n:
            ranges = [[first, last + 1]]
        else:
            ranges = to_ranges(np.asarray(offsets, dtype=np.int64)).tolist()
        pending = self._writer.pending_deliveries
        if pending and pending[-1][0] == count:
            joined = pending[-1][1]
            if joined[-1][1] == ranges[0][0]:
                joined[-1][1] = ranges[0][1]
                ranges = ranges[1:]
            joined.extend(ranges)
        else:
            pending.append((count, ranges))

    def checkpoint_deliveries(
        self, delivered: Callable[[], list[tuple[int, np.ndarray]]] | None
    ) -> None:
        """Every checkpoint from now on carries ``delivered()``: (count, ranges) of the
        unacknowledged messages delivered so far (``record_deliveries``)."""
        self._writer.delivered = delivered

    def checkpoint_duplicate_ids(self, ids: RememberedIds | None) -> None:
        """Every checkpoint from now on carries the producer ids the queue remembers
        (``raymq.core.duplicate_ids``), and segments holding ids not yet in a durable
        checkpoint are not deleted."""
        self._writer.duplicate_ids = ids

    @property
    def unlinkable(self) -> list[str]:
        """Files of deleted segments, not unlinked yet (``unlink_deleted``)."""
        return self._writer.unlinkable

    # -- memory and flow to disk -----------------------------------------------------

    @property
    def memory_limit(self) -> int | None:
        """Bytes of transient messages allowed in memory (None: no limit)."""
        return self._flow.memory_limit

    @memory_limit.setter
    def memory_limit(self, value: int | None) -> None:
        self._flow.memory_limit = value

    @property
    def flowing(self) -> bool:
        """True while the last transient write went to disk because memory was full."""
        return self._flow.flowing

    @property
    def flowed_messages(self) -> int:
        """Transient messages written to disk, new or existing."""
        return self._flow.flowed_messages

    @property
    def transient_bytes(self) -> int:
        """Bytes of transient messages held in memory (not flowed to disk)."""
        return self._flow.transient_bytes

    # -- statistics ------------------------------------------------------------------

    @property
    def read_cache_bytes(self) -> int:
        """The read cache's size limit (bytes)."""
        return self._cache.limit_bytes

    @property
    def cache_hits(self) -> int:
        """Reads served from the read cache."""
        return self._cache.hits

    @property
    def cache_misses(self) -> int:
        """Reads of segment files (records not in the read cache)."""
        return self._cache.misses

    @property
    def read_cache_used(self) -> int:
        """Bytes of records in the read cache."""
        return self._cache.used_bytes

    @property
    def bytes_in_memory(self) -> int:
        """Bytes of messages held in memory (transient records and the read cache)."""
        return self._flow.transient_bytes + self._cache.used_bytes

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of live segment files."""
        return sum(s.size for s in self.segments if s.fd is not None)

    @property
    def bytes_queued(self) -> int:
        """Bytes of unacknowledged messages, in memory and on disk (estimated per
        segment from its size and the fraction of its messages still unacknowledged)."""
        total = 0
        for s in self.segments:
            if s.count:
                stored = s.memory_bytes if s.fd is None else s.size - s.header_size
                total += stored * (s.count - s.acked_n) // s.count
        return total

    @property
    def index_bytes(self) -> int:
        """Bytes of the in-memory index: per-record positions, per-message ack flags,
        property summaries (per-message metadata counts against the memory budget)."""
        return sum(s.index_bytes for s in self.segments)

    @property
    def segment_files(self) -> int:
        """Number of live segment files."""
        return sum(1 for s in self.segments if s.fd is not None)

    # -- closing ---------------------------------------------------------------------

    def close(self) -> None:
        """Close every file descriptor; files stay (deleted segments' files go)."""
        self._writer.unlink_deleted()
        for seg in self.segments:
            seg.close()
        self._writer.close()
        if self._lock is not None:  # last: nothing of ours is open any more
            self._lock.release()
