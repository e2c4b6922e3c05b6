"""The writer: group commits of acks, records and checkpoints, in three steps.

``prepare`` (assign offsets, plan positions; in the event loop), ``write`` (the I/O and
fsyncs only; in a worker thread, touching no shared state) and ``publish`` (index the
records, delete fully acknowledged segments; in the event loop; ``abort`` after a
``write`` that raised). Only one write may be in flight at a time.

A commit has three independent parts, written in this order, each with its own outcome
in the ``PreparedWrite``:

1. acks (``ack_error``): they name published records only, which are on disk already;
   acks that failed stay applied in memory and are written again with the next commit;
2. records (``records_error``): each segment's records are written and fdatasynced
   before the next segment's (so only the newest segment can have an unsynced tail);
   after a failure every segment touched is cut back to its last good length and a
   segment created for the commit is removed, so a send that failed is never served;
3. the checkpoint (``checkpoint_error``), only when 1 and 2 succeeded; a failed one
   changes nothing (the current ack log stays) and is tried again later.

Errors are ``StorageError`` naming the queue, the file and the errno. They are sticky
only until a retry succeeds: when cutting back failed, every later ``prepare`` tries
again first and refuses records (not acks) until it works; then sends resume by
themselves, e.g. once a full disk has room again.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from raymq.batch import MessageBatch
from raymq.errors import StorageError
from raymq.storage.ack_state import AckState
from raymq.storage.acklog import AckLog, list_generations
from raymq.storage.checkpoint import (
    checkpoint_path,
    encode_checkpoint,
    stage_checkpoint,
)
from raymq.storage.files import fsync_directory, pwritev_all, remove_file, storage_error
from raymq.storage.flow import Flow
from raymq.storage.format import RECORD_HEADER, SEGMENT_SUFFIX, ack_log_name, segment_name
from raymq.storage.read_cache import ReadCache
from raymq.storage.record import record_header, record_payload
from raymq.storage.segment import Segment, Segments
from raymq.storage.subscriptions import SubscriptionAcks

if TYPE_CHECKING:
    from raymq.storage.loader import Deferred

log = logging.getLogger("raymq.storage")


class RememberedIds(Protocol):
    """The producer ids a queue remembers (``raymq.core.duplicate_ids``), as the
    checkpoint needs them."""

    def entries(self) -> list[tuple[str, int, float]]:
        """(id, offset, seconds since the epoch) of each id, oldest first."""
        ...

    def cover(self, planned_next: int) -> int | None:
        """An offset below which every stored message's id is in ``entries()`` (at
        most ``planned_next``, the next offset to give); None if there are no ids."""
        ...


@dataclass
class PreparedWrite:
    """One group commit: acks to log, records to write, maybe a checkpoint; and, once
    written, how each part went."""

    #: (segment, file position, record buffers, batch, bytes) per record, in offset
    #: order; no buffers for a transient record kept in memory.
    items: list[tuple[Segment, int, list, MessageBatch, int]] = field(default_factory=list)
    new_segments: list[Segment] = field(default_factory=list)
    ack_ranges: np.ndarray | None = None
    #: Each subscription's acks (an address's), by subscription id, logged with
    #: ``ack_ranges`` in one record (``ack_ranges`` is then at least empty).
    subscription_ranges: dict[int, np.ndarray] | None = None
    #: Delays of nacked messages in the same record: (due µs, ranges).
    delays: list[tuple[int, np.ndarray]] = field(default_factory=list)
    #: Delivery counts in the same record: (count, ranges), in the order they changed.
    deliveries: list[tuple[int, np.ndarray]] = field(default_factory=list)
    ack_log: AckLog | None = None
    #: The queue's next offset when prepared, recorded with the acks.
    ack_high: int = 0
    checkpoint: bytes | None = None
    checkpoint_generation: int = 0
    #: The checkpoint holds the producer id of every message below this offset (None:
    #: it holds none, and none is being stored).
    ids_cover: int | None = None
    next_ack_log: AckLog | None = None
    #: What recovery left to this checkpoint (``Writer.deferred``), done with it.
    deferred: Deferred | None = None
    deletable: list[Segment] = field(default_factory=list)
    #: First offset given to each input batch, in the order of the batches.
    firsts: list[int] = field(default_factory=list)
    #: Outcomes (None: the part succeeded or had nothing to do).
    records_error: StorageError | None = None
    ack_error: StorageError | None = None
    checkpoint_error: StorageError | None = None
    acks_written: bool = False
    checkpoint_written: bool = False
    #: The checkpoint's rename is not known to be durable (its directory fsync failed).
    checkpoint_unsynced: bool = False
    previous_active: Segment | None = None
    finished: bool = False

    @property
    def write_bytes(self) -> int:
        """Bytes of records this write appends."""
        return sum(item[4] for item in self.items)

    @property
    def message_count(self) -> int:
        """Messages this write appends."""
        return sum(len(item[3]) for item in self.items)


class Writer:
    """Appends records to the active segment (or memory), logs acks, takes checkpoints."""

    def __init__(
        self,
        directory: str,
        *,
        queue: str,
        page_size_bytes: int,
        durable: bool,
        segments: Segments,
        acks: AckState,
        cache: ReadCache,
        flow: Flow,
    ):
        self.directory = directory
        self.queue = queue
        self.page_size_bytes = page_size_bytes
        self.durable = durable
        self.segments = segments
        self.acks = acks
        self.cache = cache
        self.flow = flow
        #: An address's subscriptions: their acks go to the ack log with the commit's.
        self.subscriptions: SubscriptionAcks | None = None
        self.next_offset = 0  # one past the last published offset
        self._planned_next = 0
        self._active: Segment | None = None
        self.ack_log: AckLog | None = None
        self.ack_generation = 0
        #: Files to cut back or remove after a failed write, and the error that stays
        #: until that worked.
        self._repairs: list[tuple[str, Segment]] = []
        self._repair_error: StorageError | None = None
        #: Files of deleted segments, not unlinked yet (``unlink_deleted``).
        self.unlinkable: list[str] = []
        #: Names of segment files deleted, for a replicated queue's followers (taken
        #: with each ``MirrorWrite``; None: not replicated, not kept).
        self.deleted_names: list[str] | None = None
        #: Files of deleted segments whose unlink failed: named in every checkpoint (so
        #: that recovery removes them unread) and tried again before each one.
        self.undeleted: list[str] = []
        #: Failures, counted (each is logged): commits whose records, acks or checkpoint
        #: failed, and files that could not be unlinked.
        self.storage_errors = self.checkpoint_failures = 0
        self.last_error: StorageError | None = None
        #: What recovery left to the first checkpoint (an address's, when it found
        #: damage): every commit takes a checkpoint until one is durable.
        self.deferred: Deferred | None = None
        #: The producer ids each checkpoint carries (``raymq.core.duplicate_ids``);
        #: None: none. While it holds any, a segment is deleted only once a durable
        #: checkpoint has every id stored in it (``ids_checkpointed_below``): the
        #: checkpoint is then the only place they are kept.
        self.duplicate_ids: RememberedIds | None = None
        self.ids_checkpointed_below = 0
        #: Nacks' delays and delivery counts for the next ack record: (due µs, ranges)
        #: and (count, [[start, end], ...]) in the order they changed; and the functions
        #: giving what every checkpoint carries: (offset, due µs) of each message
        #: waiting out a delay, (count, ranges) of each one delivered (None: nothing).
        self.pending_delays: list[tuple[int, np.ndarray]] = []
        self.pending_deliveries: list[tuple[int, list[list[int]]]] = []
        self.delayed: Callable[[], list[tuple[int, int]]] | None = None
        self.delivered: Callable[[], list[tuple[int, np.ndarray]]] | None = None

    @property
    def planned_next(self) -> int:
        """The next offset once the write in flight (if any) is published."""
        return self._planned_next

    @property
    def writable(self) -> bool:
        """False while a failed write is not yet cut back (records are refused)."""
        return not self._repairs

    def resume(
        self,
        next_offset: int,
        ack_log: AckLog | None,
        ack_generation: int,
        undeleted: list[str] | None = None,
    ) -> None:
        """Continue after recovery: offsets from ``next_offset``, acks to ``ack_log``.
        Records are appended to the last segment only if it is a version-2 file that
        ends at ``next_offset``."""
        self.next_offset = self._planned_next = next_offset
        self.ack_log, self.ack_generation = ack_log, ack_generation
        self.undeleted = list(undeleted or [])
        last = self.segments[-1] if self.segments else None
        if last is not None and last.end_offset == next_offset and last.appendable:
            self._active = last

    # -- prepare ---------------------------------------------------------------------

    def prepare(
        self,
        batches: list[MessageBatch],
        now_us: int,
        *,
        checkpoint: bool = False,
        counts: bool = True,
    ) -> PreparedWrite:
        """Plan one group commit of ``batches``, pending acks and maybe a checkpoint.

        Assigns offsets and timestamps (``now_us``, microseconds since the epoch). If
        the records cannot be written (a failed write not yet cut back, or a segment
        file that cannot be created), ``records_error`` says why and ``write`` raises
        it after writing the acks; a non-durable queue raises it here. ``counts``
        False: pending delivery counts wait for a later write unless this one writes
        the ack log anyway (a send's commit then costs one fdatasync, not two).
        """
        prepared = PreparedWrite(previous_active=self._active, ack_high=self.next_offset)
        refused = self._repair()
        if refused is None and batches:
            refused = self._plan_or_refuse(batches, now_us, prepared)
        if refused is not None and batches:
            if not self.durable:
                raise refused
            prepared.records_error = refused
        if self.durable:
            self._take_acks(prepared, counts or checkpoint or self.deferred is not None)
            if (checkpoint or self.deferred is not None) and refused is None:
                self._plan_checkpoint(prepared)
        prepared.deletable = self._deletable(prepared)
        return prepared

    def _plan_or_refuse(
        self, batches: list[MessageBatch], now_us: int, prepared: PreparedWrite
    ) -> StorageError | None:
        """Plan the records of ``batches`` into ``prepared`` (see ``_plan``); the error
        that refuses them if a segment file cannot be created, with nothing left planned
        and the error noted as the last one."""
        try:
            self._plan(batches, now_us, prepared)
        except OSError as exc:
            path = exc.filename if isinstance(exc.filename, str) else self._new_path()
            refused = storage_error(self.queue, "creating a segment", path, exc)
            self._roll_back(prepared)
            prepared.items, prepared.new_segments, prepared.firsts = [], [], []
            self._note(refused)
            return refused
        except BaseException:  # a bug: leave nothing half planned
            self._roll_back(prepared)
            raise
        return None

    def _take_acks(self, prepared: PreparedWrite, counts: bool) -> None:
        """Move the acks waiting for the ack log (the queue's, and an address's per
        subscription) into ``prepared``, with the ack log they go to; the delivery
        counts too if ``counts`` or the ack log is written anyway (a checkpoint always
        takes them: the ack log it retires must hold every count before it)."""
        prepared.ack_ranges = self.acks.take_pending()
        if self.subscriptions is not None:
            prepared.subscription_ranges = self.subscriptions.take_pending()
            if prepared.subscription_ranges and prepared.ack_ranges is None:
                prepared.ack_ranges = np.zeros((0, 2), dtype=np.int64)
        prepared.delays, self.pending_delays = self.pending_delays, []
        if counts or prepared.ack_ranges is not None or prepared.delays:
            prepared.deliveries = [
                (n, np.array(r, dtype=np.int64).reshape(-1, 2)) for n, r in self.pending_deliveries
            ]
            self.pending_deliveries = []
        if (prepared.delays or prepared.deliveries) and prepared.ack_ranges is None:
            prepared.ack_ranges = np.zeros((0, 2), dtype=np.int64)
        prepared.ack_log = self.ack_log

    def _plan_checkpoint(self, prepared: PreparedWrite) -> None:
        """Encode the next generation's checkpoint into ``prepared``, with the ack log
        that starts with it (and what recovery deferred to it, if anything)."""
        deferred = self.deferred
        gen = self.ack_generation + 1
        # Every message published so far was routed (after its commit).
        sections, routed_to = None, self.next_offset
        if self.subscriptions is not None:
            sections = self.subscriptions.checkpoint_section()
        elif deferred is not None:  # not attached yet: what recovery found
            sections, routed_to = deferred.sections, deferred.routed_to
        ids = self.duplicate_ids
        if ids is not None:
            prepared.ids_cover = ids.cover(self._planned_next)
        prepared.checkpoint = encode_checkpoint(
            self.segments,
            self.next_offset,
            gen,
            self._still_undeleted(),
            sections,
            routed_to,
            None if ids is None else ids.entries(),
            None if self.delayed is None else self.delayed(),
            None if self.delivered is None else self.delivered(),
        )
        prepared.checkpoint_generation = gen
        prepared.next_ack_log = AckLog(self.directory, gen)
        prepared.deferred = deferred

    def _deletable(self, prepared: PreparedWrite) -> list[Segment]:
        """Segments this commit may delete: fully acknowledged, with nothing planned
        that is not yet published (in ``prepared`` or a write before it), and not the
        newest."""
        written = {id(item[0]) for item in prepared.items}
        # The newest segment stays, even fully acknowledged: its name and records keep
        # the highest offset given, whatever happens to the ack log and checkpoint.
        newest = self.segments[-1] if len(self.segments) else None
        below, ids = 2**63, self.duplicate_ids
        if ids is not None and ids.cover(self._planned_next) is not None:
            below = self.ids_checkpointed_below
        return [
            s
            for s in self.segments
            if s.fully_acked
            and s.planned_size == s.size
            and id(s) not in written
            and s is not newest
            and s.end_offset <= below
        ]

    def _plan(self, batches: list[MessageBatch], now_us: int, prepared: PreparedWrite) -> None:
        in_memory = self.flow.transient_bytes
        for batch in batches:
            prepared.firsts.append(self._planned_next)
            for chunk in self._split(batch):
                first = chunk.first_offset = self._planned_next
                chunk.timestamps = np.full(len(chunk), now_us, dtype=np.int64)
                on_disk = self.durable or self.flow.must_flow(in_memory + chunk.nbytes)
                if on_disk:
                    payload, length, pcrc = record_payload(chunk)
                    size = RECORD_HEADER.size + length
                else:
                    size = chunk.nbytes
                    in_memory += size
                seg = self._segment_for(size, first, prepared, on_disk)
                pos = seg.planned_size
                bufs = []
                if on_disk:
                    bufs = [record_header(pcrc, length, first, len(chunk), seg.salt, pos), *payload]
                prepared.items.append((seg, pos, bufs, chunk, size))
                seg.planned_size += size
                seg.planned_end = chunk.end_offset
                self._planned_next = chunk.end_offset

    def _new_path(self) -> str:
        return os.path.join(self.directory, segment_name(self._planned_next))

    def _split(self, batch: MessageBatch) -> list[MessageBatch]:
        """Cut a batch into records of at most ``page_size_bytes`` of bodies each."""
        n = len(batch)
        if n == 0:
            return []
        if batch.body_offsets[-1] + batch.prop_offsets[-1] <= self.page_size_bytes:
            return [batch]
        chunks, start = [], 0
        cum = batch.body_offsets + batch.prop_offsets
        while start < n:
            stop = int(np.searchsorted(cum, cum[start] + self.page_size_bytes, side="right")) - 1
            stop = min(max(stop, start + 1), n)
            chunks.append(batch.slice(start, stop))
            start = stop
        return chunks

    def _segment_for(
        self, size: int, first: int, prepared: PreparedWrite, on_disk: bool = True
    ) -> Segment:
        seg = self._active
        if seg is not None and (
            seg.planned_end != first
            or (seg.planned_end > seg.base_offset and seg.planned_size + size > self._page_limit)
            or (seg.fd is not None) != on_disk  # transient records switch memory <-> disk
        ):
            seg = None
        if seg is None:
            seg = Segment.create(self.directory, first) if on_disk else Segment(None, first)
            prepared.new_segments.append(seg)
            self.segments.append(seg)
            self._active = seg
        return seg

    @property
    def _page_limit(self) -> int:
        """Bytes a segment may reach before the next record goes to a new one."""
        return self.page_size_bytes + RECORD_HEADER.size

    # -- write -----------------------------------------------------------------------

    def write(self, prepared: PreparedWrite) -> None:
        """Do the I/O of a prepared write: acks, records, maybe a checkpoint.

        Safe to run in a worker thread: it touches only files. Raises the
        ``StorageError`` of the records, else of the acks, if either failed (the
        outcome of each part is in ``prepared``). Transient records that flowed to disk
        are written but not fsynced: they promise nothing across a crash, and a
        non-durable queue starts empty.
        """
        if prepared.ack_ranges is not None and prepared.ack_log is not None:
            try:
                prepared.ack_log.write(
                    prepared.ack_ranges,
                    prepared.ack_high,
                    prepared.subscription_ranges,
                    prepared.delays,
                    prepared.deliveries,
                )
                prepared.acks_written = True
            except OSError as exc:
                path = prepared.ack_log.path
                prepared.ack_error = storage_error(self.queue, "appending acks", path, exc)
        if prepared.records_error is None and prepared.items:
            try:
                self._write_records(prepared)
            except _WriteFailed as failed:
                prepared.records_error = storage_error(
                    self.queue, failed.action, failed.path, failed.cause
                )
        if (
            prepared.checkpoint is not None
            and prepared.records_error is None
            and prepared.ack_error is None
        ):
            self._write_checkpoint(prepared)
        error = prepared.records_error or prepared.ack_error
        if error is not None:
            raise error

    def _write_records(self, prepared: PreparedWrite) -> None:
        """Each segment's records with one pwritev then fdatasync, in offset order (a
        new segment's header first); then the directory if segments were created."""
        new = {id(s) for s in prepared.new_segments}
        created = False
        for seg, pos, bufs in by_segment(prepared.items):
            if not bufs:
                continue
            if id(seg) in new:
                bufs, pos, created = [seg.file_header(), *bufs], 0, True
            try:
                pwritev_all(seg.fd, bufs, pos)
            except OSError as exc:
                raise _WriteFailed("writing records", seg.path, exc) from exc
            if self.durable:
                try:
                    os.fdatasync(seg.fd)
                except OSError as exc:
                    raise _WriteFailed("fdatasync", seg.path, exc) from exc
        if created and self.durable:
            try:
                fsync_directory(self.directory)
            except OSError as exc:
                raise _WriteFailed("fsync of the directory", self.directory, exc) from exc

    def _write_checkpoint(self, prepared: PreparedWrite) -> None:
        """Start the next ack log, then stage and commit the checkpoint naming it. What
        recovery left to it: files with a bad header are renamed first, damaged ends cut
        once it is durable."""
        next_log, path = prepared.next_ack_log, checkpoint_path(self.directory)
        deferred = prepared.deferred
        if deferred is not None:
            try:
                unsynced = deferred.move_aside()
            except OSError as exc:
                unsynced = exc
            if unsynced is not None:
                where = unsynced.filename if isinstance(unsynced.filename, str) else self.directory
                prepared.checkpoint_error = storage_error(
                    self.queue, "moving damaged segments aside", where, unsynced
                )
                return
        try:
            next_log.create(prepared.ack_high)
            stage_checkpoint(self.directory, prepared.checkpoint)
        except OSError as exc:
            prepared.checkpoint_error = storage_error(self.queue, "checkpoint", path, exc)
            next_log.close()
            for stale in (next_log.path, path + ".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(stale)
            return
        try:
            os.replace(path + ".tmp", path)
        except OSError as exc:
            prepared.checkpoint_error = storage_error(self.queue, "checkpoint", path, exc)
            next_log.close()
            with contextlib.suppress(OSError):
                os.unlink(next_log.path)
            return
        prepared.checkpoint_written = True
        try:
            fsync_directory(self.directory)
        except OSError as exc:
            prepared.checkpoint_error = storage_error(self.queue, "checkpoint", path, exc)
            prepared.checkpoint_unsynced = True
            return
        if deferred is not None:
            deferred.cut()

    # -- publish / abort -------------------------------------------------------------

    def publish(self, prepared: PreparedWrite) -> None:
        """Finish a write: publish its records (or, if they failed, cut them back), keep
        failed acks for the next commit, switch to the checkpoint's ack log, and delete
        segments whose acks are durable."""
        self._finish(prepared, records_ok=prepared.records_error is None)

    def abort(self, prepared: PreparedWrite) -> None:
        """Finish a write whose ``write`` raised (or never ran): nothing of its records
        is published; the parts that succeeded are kept."""
        self._finish(prepared, records_ok=False)

    def _finish(self, prepared: PreparedWrite, *, records_ok: bool) -> None:
        if prepared.finished:
            return
        prepared.finished = True
        if records_ok:
            self._publish_records(prepared)
        elif prepared.items or prepared.new_segments:
            self._roll_back(prepared)
            if prepared.records_error is not None:
                self._note(prepared.records_error)
        if prepared.ack_ranges is not None and not prepared.acks_written:
            if len(prepared.ack_ranges):
                self.acks.requeue(prepared.ack_ranges)
            if prepared.subscription_ranges and self.subscriptions is not None:
                self.subscriptions.requeue(prepared.subscription_ranges)
            self.pending_delays[:0] = prepared.delays
            self.pending_deliveries[:0] = [(n, r.tolist()) for n, r in prepared.deliveries]
            if prepared.ack_error is not None:
                self._note(prepared.ack_error)
        if prepared.checkpoint is not None:
            self._finish_checkpoint(prepared)
        if prepared.ack_ranges is None or prepared.acks_written:
            for seg in prepared.deletable:
                if seg in self.segments and seg.fully_acked:
                    self.delete_segment(seg)
        if not records_ok and self.unlinkable:
            self.unlink_deleted()  # free the space now: sends failed, maybe for lack of it

    def _publish_records(self, prepared: PreparedWrite) -> None:
        for seg, pos, _bufs, chunk, size in prepared.items:
            ts = chunk.timestamps
            seg.add_record(chunk.first_offset, len(chunk), pos, int(ts[0]) if ts is not None else 0)
            if seg.fd is None:
                seg.batches.append(chunk)
                seg.memory_bytes += chunk.nbytes
            elif not self.durable:
                self.flow.flowed_messages += len(chunk)
            seg.size = pos + size
            self.next_offset = chunk.end_offset
            self.acks.published(len(chunk))

    def _finish_checkpoint(self, prepared: PreparedWrite) -> None:
        if not prepared.checkpoint_written:
            self.checkpoint_failures += 1
            if prepared.checkpoint_error is not None:
                self._note(prepared.checkpoint_error, what="checkpoint (tried again later)")
            return
        if self.ack_log is not None:
            self.ack_log.close()
        self.ack_log = prepared.next_ack_log
        self.ack_generation = prepared.checkpoint_generation
        if prepared.checkpoint_unsynced:  # keep the older ack logs the old one names
            self.checkpoint_failures += 1
            self._note(prepared.checkpoint_error, what="checkpoint (tried again later)")
            return
        if prepared.deferred is not None:
            self.deferred = None  # what recovery left is done
        if prepared.ids_cover is not None:
            self.ids_checkpointed_below = prepared.ids_cover
        self.remove_ack_logs_before(prepared.checkpoint_generation)

    def _roll_back(self, prepared: PreparedWrite) -> None:
        """Undo the plan of a write whose records were not written (or failed): offsets
        given again, segments created for it dropped, files cut back."""
        self._planned_next = self.next_offset
        new = {id(s) for s in prepared.new_segments}
        touched = {id(s): s for s, *_ in prepared.items if id(s) not in new}
        for seg in touched.values():
            seg.planned_size, seg.planned_end = seg.size, seg.end_offset
            if seg.fd is not None:
                self._repairs.append(("truncate", seg))
        for seg in prepared.new_segments:
            if seg in self.segments:
                self.segments.remove(seg)
            if seg.fd is not None:
                seg.close()
                self._repairs.append(("unlink", seg))
        active = prepared.previous_active
        self._active = active if active is not None and active in self.segments else None
        if self._repair() is not None and self.durable and prepared.items:
            self._burn(prepared)

    def _burn(self, prepared: PreparedWrite) -> None:
        """The failed write's files could not be cut back, so its records may be on disk
        and would be served after a crash, though their send raised (found by the fault
        simulator). Record their offsets as acknowledged in the ack log and never give
        them again: recovery then never serves them, whatever file survives."""
        first = min(item[3].first_offset for item in prepared.items)
        end = max(item[3].end_offset for item in prepared.items)
        if self.ack_log is None or end <= self.next_offset:
            return
        # Never given again, even if the append below fails: it may have reached the
        # disk all the same, and would acknowledge whatever took these offsets next.
        self.next_offset = self._planned_next = end
        try:
            self.ack_log.write(np.array([[first, end]], dtype=np.int64), end)
        except OSError as exc:  # a second fault: the window FORMAT.md describes
            self._note(storage_error(self.queue, "burning a failed write", self.ack_log.path, exc))

    def _repair(self) -> StorageError | None:
        """Cut back or remove the files of failed writes; None once nothing is left to
        do, else the error that refuses records until it works."""
        if not self._repairs:
            return None
        left: list[tuple[str, Segment | None]] = []
        error = None
        sync = False
        for action, seg in self._repairs:
            try:
                if action == "truncate" and seg.fd is not None:  # (fd None: deleted since)
                    os.ftruncate(seg.fd, seg.size)
                    if self.durable:
                        os.fdatasync(seg.fd)
                elif action == "unlink":
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(seg.path)
                    sync = True
                elif action == "sync":
                    sync = True
            except OSError as exc:
                left.append((action, seg))
                error = storage_error(self.queue, f"{action} after a failed write", seg.path, exc)
        if sync and self.durable:
            try:
                fsync_directory(self.directory)
            except OSError as exc:
                left.append(("sync", None))
                error = storage_error(self.queue, "fsync of the directory", self.directory, exc)
        self._repairs = left
        self._repair_error = error
        if error is not None:
            self._note(error, what="repair (tried again with the next write)")
        return error

    def _note(self, error: StorageError, what: str = "write") -> None:
        self.storage_errors += 1
        self.last_error = error
        log.warning("queue %r: %s failed: %s", self.queue, what, error)

    # -- deleting --------------------------------------------------------------------

    def delete_segment(self, seg: Segment) -> None:
        """Forget a fully acknowledged segment; its file goes with ``unlink_deleted``."""
        self.segments.remove(seg)
        if seg is self._active:
            self._active = None
        self.cache.drop_segment(seg.base_offset)
        seg.close()
        if seg.path:
            self.unlinkable.append(seg.path)
            if self.deleted_names is not None:
                self.deleted_names.append(os.path.basename(seg.path))

    def unlink_deleted(self) -> None:
        """Unlink the files of segments deleted since the last call.

        Apart so that the caller may do it off its event loop: freeing a 10 MiB file
        takes ~3 ms here. Offsets only grow while the log is open, so no new segment
        can take a pending file's name; a crash before the unlink leaves a fully
        acknowledged file, which recovery deletes. An unlink that fails is logged and
        the file named in every checkpoint until an unlink works (``undeleted``), so
        that recovery deletes it too.
        """
        paths, self.unlinkable = self.unlinkable, []
        for path in paths:
            exc = remove_file(path)
            if exc is not None:
                self.undeleted.append(path)
                self._note(storage_error(self.queue, "unlink", path, exc), what="unlink")

    def _still_undeleted(self) -> list[int]:
        """Base offsets of deleted segments whose file is still there (unlinks that
        failed are tried again first)."""
        left = [path for path in self.undeleted if remove_file(path) is not None]
        self.undeleted = left
        return [int(os.path.basename(p)[: -len(SEGMENT_SUFFIX)]) for p in left]

    def remove_ack_logs_before(self, generation: int) -> None:
        """Unlink the ack logs a checkpoint made obsolete (a failure is logged; the next
        checkpoint tries again)."""
        try:
            generations = list_generations(self.directory)
        except OSError as exc:
            self._note(storage_error(self.queue, "listing", self.directory, exc), what="unlink")
            return
        for gen in generations:
            if gen < generation:
                path = os.path.join(self.directory, ack_log_name(gen))
                exc = remove_file(path)
                if exc is not None:
                    self._note(storage_error(self.queue, "unlink", path, exc), what="unlink")

    def close(self) -> None:
        """Close the ack log."""
        if self.ack_log is not None:
            self.ack_log.close()
            self.ack_log = None


class _WriteFailed(Exception):
    """Which step of writing records failed, on which file."""

    def __init__(self, action: str, path: str, cause: OSError):
        super().__init__(action, path)
        self.action, self.path, self.cause = action, path, cause


def by_segment(items: list) -> list[tuple[Segment, int, list]]:
    """(segment, first position, buffers) per run of items in the same segment."""
    runs: list[tuple[Segment, int, list]] = []
    for seg, pos, bufs, _chunk, _size in items:
        if runs and runs[-1][0] is seg:
            runs[-1][2].extend(bufs)
        else:
            runs.append((seg, pos, list(bufs)))
    return runs
