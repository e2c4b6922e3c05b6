"""SegmentLog: the QueueArea of one queue, its page files, acks, checkpoints and recovery.

Writes happen in three steps so that an async actor can keep serving while the disk
works: ``prepare`` (assign offsets, plan positions; in the event loop), ``write`` (the
I/O and fsyncs only; in a worker thread, touching no shared state) and ``publish``
(index the records, delete fully acknowledged segments; in the event loop). Only one
write may be in flight at a time. Everything else runs in the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack
import numpy as np

from raymq.batch import MessageBatch
from raymq.errors import StorageError
from raymq.storage.acklog import AckLog, list_generations, read_ack_log, to_ranges
from raymq.storage.format import (
    CHECKPOINT_HEADER,
    CHECKPOINT_MAGIC,
    CHECKPOINT_NAME,
    CHECKPOINT_VERSION,
    RECORD_HEADER,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    SEGMENT_SUFFIX,
    SEGMENT_VERSION,
    ack_log_name,
    crc32,
    segment_name,
)
from raymq.storage.segment import CorruptRecord, Segment, encode_record, scan

log = logging.getLogger("raymq.storage")
_IOV_MAX = 1020


@dataclass
class RecoveryReport:
    """What opening a queue's files found and repaired."""

    queue: str
    segments: int = 0
    depth: int = 0
    next_offset: int = 0
    used_checkpoint: bool = False
    truncated_bytes: int = 0
    lost_messages: int = 0
    damage: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class PreparedWrite:
    """One group commit: records to write, acks to log, maybe a checkpoint."""

    items: list[tuple[Segment, int, list, MessageBatch, int]] = field(default_factory=list)
    new_segments: list[Segment] = field(default_factory=list)
    ack_ranges: np.ndarray | None = None
    ack_log: AckLog | None = None
    checkpoint: bytes | None = None
    checkpoint_generation: int = 0
    deletable: list[Segment] = field(default_factory=list)
    #: First offset given to each input batch, in the order of the batches.
    firsts: list[int] = field(default_factory=list)

    @property
    def write_bytes(self) -> int:
        """Bytes of records this write appends."""
        return sum(item[4] for item in self.items)

    @property
    def message_count(self) -> int:
        """Messages this write appends."""
        return sum(len(item[3]) for item in self.items)


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
        self.segments: list[Segment] = []
        self.next_offset = 0  # one past the last published offset
        self._planned_next = 0
        self._active: Segment | None = None
        self._pending_acks: list[np.ndarray] = []
        self._ack_log: AckLog | None = None
        self._ack_generation = 0
        self.depth = 0  # published, unacknowledged messages
        self._failed: StorageError | None = None
        self._cache: OrderedDict[tuple[int, int], MessageBatch] = OrderedDict()
        self._cache_bytes = 0
        #: Files of deleted segments, not unlinked yet (``unlink_deleted``).
        self.unlinkable: list[str] = []
        self.read_cache_bytes = read_cache_bytes
        self.cache_hits = 0
        self.cache_misses = 0
        #: Bytes of transient (non-durable) messages allowed in memory; beyond it they
        #: flow to disk (Qpid). None: no limit. Durable messages are always on disk.
        self.memory_limit: int | None = None
        #: True while the last transient write went to disk because memory was full.
        self.flowing = False
        self.flowed_messages = 0  # transient messages written to disk, new or existing

    # -- opening and recovery --------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str,
        *,
        queue: str,
        page_size_bytes: int,
        durable: bool = True,
        read_cache_bytes: int = 64 * 2**20,
    ) -> tuple[SegmentLog, RecoveryReport]:
        """Open (creating if needed) the queue's directory and recover its state.

        A non-durable queue starts empty and keeps its messages in memory.
        """
        t0 = time.perf_counter()
        os.makedirs(directory, exist_ok=True)
        self = cls(
            directory,
            queue=queue,
            page_size_bytes=page_size_bytes,
            durable=durable,
            read_cache_bytes=read_cache_bytes,
        )
        report = RecoveryReport(queue=queue)
        if durable:
            self._recover(report)
        else:
            self._remove_transient_files()
        report.segments = len(self.segments)
        report.depth = self.depth
        report.next_offset = self.next_offset
        report.seconds = time.perf_counter() - t0
        for line in report.damage:
            log.warning("queue %r: %s", queue, line)
        return self, report

    def _recover(self, report: RecoveryReport) -> None:
        ckpt = self._read_checkpoint(report)
        ckpt_segments = {s["base"]: s for s in ckpt["segments"]} if ckpt else {}
        report.used_checkpoint = ckpt is not None
        for base in self._segment_bases():
            seg = self._recover_segment(base, ckpt_segments.get(base), report)
            if seg is not None:
                self.segments.append(seg)
        first_gen = ckpt["ack_generation"] if ckpt else 0
        max_ack_end = 0
        generations = list_generations(self.directory)
        for gen in generations:
            if gen < first_gen:
                continue
            ranges, damage = read_ack_log(os.path.join(self.directory, ack_log_name(gen)))
            report.damage.extend(damage)
            if len(ranges):
                max_ack_end = max(max_ack_end, int(ranges[:, 1].max()))
                self._apply_ranges(ranges)
        last_end = self.segments[-1].end_offset if self.segments else 0
        self.next_offset = max(ckpt["next_offset"] if ckpt else 0, last_end, max_ack_end)
        self._planned_next = self.next_offset
        for seg in self.segments:
            report.lost_messages += seg.lost_n
        self.depth = sum(s.count - s.acked_n for s in self.segments)
        if self.segments and self.segments[-1].end_offset == self.next_offset:
            self._active = self.segments[-1]
        # Start a fresh ack generation and checkpoint now, so that the ack logs just
        # replayed are never replayed again (offsets of deleted segments may be reused).
        self._ack_generation = max([first_gen, *generations]) + 1
        self._ack_log = AckLog(self.directory, self._ack_generation)
        self._write_checkpoint(self._snapshot(self._ack_generation))
        self._remove_ack_logs_before(self._ack_generation)
        for seg in [s for s in self.segments if s.fully_acked]:
            self._delete_segment(seg)
        self.unlink_deleted()

    def _remove_transient_files(self) -> None:
        """A non-durable queue starts empty: what flowed to disk last run is garbage."""
        for base in self._segment_bases():
            os.unlink(os.path.join(self.directory, segment_name(base)))

    def _segment_bases(self) -> list[int]:
        bases = []
        for name in os.listdir(self.directory):
            if name.endswith(SEGMENT_SUFFIX):
                try:
                    bases.append(int(name[: -len(SEGMENT_SUFFIX)]))
                except ValueError:
                    continue
        return sorted(bases)

    def _recover_segment(
        self, base: int, saved: dict | None, report: RecoveryReport
    ) -> Segment | None:
        try:
            seg, data = Segment.open_existing(self.directory, base)
            seg.summary = None  # unknown until a scan reads its properties
        except CorruptRecord as exc:
            path = os.path.join(self.directory, f"{base:020d}{SEGMENT_SUFFIX}")
            os.replace(path, path + ".damaged")
            report.damage.append(f"{exc}; moved aside to {path}.damaged")
            return None
        start = seg.size
        if saved is not None and saved["size"] <= len(data):
            seg.firsts.frombytes(saved["firsts"])
            seg.positions.frombytes(saved["positions"])
            seg.count = saved["count"]
            packed = np.frombuffer(saved["acked"], dtype=np.uint8)
            flags = np.unpackbits(packed, count=saved["count"])
            seg.set_acked(flags.astype(np.bool_), saved["acked_n"])
            seg.lost_n = saved["lost_n"]
            start = saved["size"]
        result = scan(data, start, seg.path)
        for first, count, pos in result.records:
            seg.add_record(first, count, pos)
        report.damage.extend(result.damage)
        if result.truncated_bytes:
            report.truncated_bytes += result.truncated_bytes
            os.ftruncate(seg.fd, result.valid_end)
            os.fsync(seg.fd)
        seg.size = seg.planned_size = result.valid_end
        seg.planned_end = seg.end_offset
        if seg.count == 0:
            seg.delete()
            return None
        return seg

    def _apply_ranges(self, ranges: np.ndarray) -> None:
        for start, end in ranges:
            self.ack(np.arange(start, end, dtype=np.int64), log_it=False)

    # -- checkpoints -----------------------------------------------------------------

    def _snapshot(self, ack_generation: int) -> bytes:
        body = msgpack.packb(
            {
                "next_offset": self.next_offset,
                "ack_generation": ack_generation,
                "segments": [
                    {
                        "base": s.base_offset,
                        "size": s.size,
                        "count": s.count,
                        "acked_n": s.acked_n,
                        "lost_n": s.lost_n,
                        "firsts": s.firsts.tobytes(),
                        "positions": s.positions.tobytes(),
                        "acked": np.packbits(s.acked).tobytes(),
                    }
                    for s in self.segments
                    if s.count
                ],
            }
        )
        header = CHECKPOINT_HEADER.pack(
            CHECKPOINT_MAGIC, CHECKPOINT_VERSION, crc32([body]), len(body)
        )
        return header + body

    def _write_checkpoint(self, data: bytes) -> None:
        tmp = os.path.join(self.directory, CHECKPOINT_NAME + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.directory, CHECKPOINT_NAME))
        self._fsync_directory()

    def _read_checkpoint(self, report: RecoveryReport) -> dict | None:
        path = os.path.join(self.directory, CHECKPOINT_NAME)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        hs = CHECKPOINT_HEADER.size
        if len(data) >= hs:
            magic, version, crc, length = CHECKPOINT_HEADER.unpack_from(data, 0)
            body = data[hs : hs + length]
            if (
                magic == CHECKPOINT_MAGIC
                and version == CHECKPOINT_VERSION
                and len(body) == length
                and crc32([body]) == crc
            ):
                return msgpack.unpackb(body)
        report.damage.append(f"{path}: damaged checkpoint ignored; all files rescanned")
        return None

    def _remove_ack_logs_before(self, generation: int) -> None:
        for gen in list_generations(self.directory):
            if gen < generation:
                os.unlink(os.path.join(self.directory, ack_log_name(gen)))

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- writing ---------------------------------------------------------------------

    def prepare(
        self, batches: list[MessageBatch], now_us: int, *, checkpoint: bool = False
    ) -> PreparedWrite:
        """Plan one group commit of ``batches``, pending acks and maybe a checkpoint.

        Assigns offsets and timestamps (``now_us``, microseconds since the epoch).
        Raises ``StorageError`` if an earlier write failed (errors are sticky).
        """
        if self._failed is not None:
            raise self._failed
        prepared = PreparedWrite()
        in_memory = self.transient_bytes
        for batch in batches:
            prepared.firsts.append(self._planned_next)
            for chunk in self._split(batch):
                chunk.first_offset = self._planned_next
                chunk.timestamps = np.full(len(chunk), now_us, dtype=np.int64)
                on_disk = self.durable or self._must_flow(in_memory + chunk.nbytes)
                if on_disk:
                    bufs = encode_record(chunk)
                    size = sum(memoryview(b).nbytes for b in bufs)
                else:
                    bufs, size = [], chunk.nbytes
                    in_memory += size
                seg = self._segment_for(size, chunk.first_offset, prepared, on_disk)
                prepared.items.append((seg, seg.planned_size, bufs, chunk, size))
                seg.planned_size += size
                seg.planned_end = chunk.end_offset
                self._planned_next = chunk.end_offset
        if self._pending_acks:
            prepared.ack_ranges = to_ranges(np.concatenate(self._pending_acks))
            self._pending_acks = []
        if self.durable:
            prepared.ack_log = self._ack_log
            if checkpoint:
                gen = self._ack_generation + 1
                prepared.checkpoint = self._snapshot(gen)
                prepared.checkpoint_generation = gen
                self._ack_generation = gen
                self._ack_log = AckLog(self.directory, gen)
        written = {id(item[0]) for item in prepared.items}
        prepared.deletable = [
            s
            for s in self.segments
            if s.fully_acked and s.planned_size == s.size and id(s) not in written
        ]
        return prepared

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

    def _must_flow(self, transient_bytes: int) -> bool:
        """Should a transient record go to disk, given memory would then hold
        ``transient_bytes`` (bytes)? Also notes the decision in ``flowing``."""
        self.flowing = self.memory_limit is not None and transient_bytes > self.memory_limit
        return self.flowing

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

    def write(self, prepared: PreparedWrite) -> None:
        """Do the I/O of a prepared write: records, fdatasync, ack log, checkpoint.

        Safe to run in a worker thread: it touches only file descriptors. On an OS
        error the log refuses every later write with the same ``StorageError``.
        Transient records that flowed to disk are written but not fsynced: they
        promise nothing across a crash, and a non-durable queue starts empty.
        """
        try:
            touched: dict[int, Segment] = {}
            for seg, pos, bufs, _chunk, _size in prepared.items:
                if bufs:
                    _pwritev_all(seg.fd, bufs, pos)
                    touched[id(seg)] = seg
            if not self.durable:
                return
            for seg in touched.values():
                os.fdatasync(seg.fd)
            if prepared.new_segments:
                self._fsync_directory()
            if prepared.ack_ranges is not None and prepared.ack_log is not None:
                prepared.ack_log.write(prepared.ack_ranges)
            if prepared.checkpoint is not None:
                self._write_checkpoint(prepared.checkpoint)
        except OSError as exc:
            self._failed = StorageError(
                f"queue {self.queue!r}: write to {self.directory} failed: {exc}"
            )
            raise self._failed from exc

    def publish(self, prepared: PreparedWrite) -> None:
        """Make written records readable and delete segments that were fully acknowledged."""
        for seg, pos, _bufs, chunk, size in prepared.items:
            seg.add_record(chunk.first_offset, len(chunk), pos)
            if seg.fd is None:
                seg.batches.append(chunk)
                seg.memory_bytes += chunk.nbytes
            elif not self.durable:
                self.flowed_messages += len(chunk)
            seg.size = pos + size
            self.next_offset = chunk.end_offset
            self.depth += len(chunk)
        if prepared.checkpoint is not None:
            if prepared.ack_log is not None and prepared.ack_log is not self._ack_log:
                prepared.ack_log.close()
            self._remove_ack_logs_before(prepared.checkpoint_generation)
        for seg in prepared.deletable:
            if seg in self.segments and seg.fully_acked:
                self._delete_segment(seg)

    def abort(self, prepared: PreparedWrite) -> None:
        """Forget a prepared write whose I/O failed (offsets are not published)."""
        self._planned_next = self.next_offset
        self._active = None

    def _delete_segment(self, seg: Segment) -> None:
        """Forget a fully acknowledged segment; its file goes with ``unlink_deleted``."""
        self.segments.remove(seg)
        if seg is self._active:
            self._active = None
        for key in [k for k in self._cache if k[0] == seg.base_offset]:
            self._cache_bytes -= self._cache.pop(key).nbytes
        seg.close()
        if seg.path:
            self.unlinkable.append(seg.path)

    def unlink_deleted(self) -> None:
        """Unlink the files of segments deleted since the last call.

        Apart so that the caller may do it off its event loop: freeing a 10 MiB file
        takes ~3 ms here. Offsets only grow while the log is open, so no new segment
        can take a pending file's name; a crash before the unlink leaves a fully
        acknowledged file, which recovery deletes.
        """
        paths, self.unlinkable = self.unlinkable, []
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # -- acknowledgements ------------------------------------------------------------

    def ack(self, offsets: np.ndarray, *, log_it: bool = True) -> int:
        """Mark published offsets acknowledged; returns how many were newly acked.

        Offsets outside the live segments (already deleted, or never published) are
        ignored. The ack reaches disk with the next ``prepare``/``write``.
        """
        offsets = np.asarray(offsets, dtype=np.int64)
        if not len(offsets) or not self.segments:
            return 0
        where = np.searchsorted(self._bases(), offsets, side="right") - 1
        fresh = 0
        for i in np.unique(where[where >= 0]):
            seg = self.segments[i]
            mine = offsets[(where == i)]
            mine = mine[mine < seg.end_offset]
            if len(mine):
                fresh += seg.ack(mine)
                if seg.fd is None:
                    seg.free_acked_records(int(mine.min()), int(mine.max()))
        self.depth -= fresh
        if log_it and self.durable and len(offsets):
            self._pending_acks.append(offsets)
        return fresh

    @property
    def has_pending_acks(self) -> bool:
        """True when acks wait for the next write."""
        return bool(self._pending_acks)

    # -- reading ---------------------------------------------------------------------

    def _bases(self) -> np.ndarray:
        """First offsets of the live segments, ascending."""
        return np.fromiter(
            (s.base_offset for s in self.segments), dtype=np.int64, count=len(self.segments)
        )

    def _segment_at(self, offset: int) -> int:
        """Index of the first segment that may hold ``offset`` or anything after it."""
        return max(0, int(np.searchsorted(self._bases(), offset, side="right")) - 1)

    def unacked(self, start: int, limit: int, end: int | None = None) -> np.ndarray:
        """Up to ``limit`` unacknowledged published offsets >= ``start`` (and < ``end``)."""
        end = self.next_offset if end is None else min(end, self.next_offset)
        out, need = [], limit
        i = self._segment_at(start)
        for seg in self.segments[i:]:
            if need <= 0 or seg.base_offset >= end:
                break
            lo = max(start, seg.base_offset) - seg.base_offset
            hi = min(end, seg.end_offset) - seg.base_offset
            if hi <= lo or seg.acked_n == seg.count:
                continue
            idx = np.flatnonzero(~seg.acked[lo:hi])[:need]
            out.append(idx + (seg.base_offset + lo))
            need -= len(idx)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def is_acked(self, offsets: np.ndarray) -> np.ndarray:
        """Ack flag per offset (offsets of deleted segments count as acked)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        result = np.ones(len(offsets), dtype=np.bool_)
        if not len(offsets) or not self.segments:
            return result
        where = np.searchsorted(self._bases(), offsets, side="right") - 1
        for i in np.unique(where[where >= 0]).tolist():
            seg = self.segments[i]
            m = (where == i) & (offsets < seg.end_offset)
            if m.any():
                result[m] = seg.acked[offsets[m] - seg.base_offset]
        return result

    def read(self, start: int, end: int) -> list[MessageBatch]:
        """Messages of offsets [start, end), all published, as batches in offset order.

        Offsets in gaps (deleted segments, damaged records) are skipped.
        """
        return self._collect(start, end, self._record)

    def properties(self, start: int, end: int) -> list[MessageBatch]:
        """Like ``read`` but with empty bodies: timestamps and properties only.

        For a durable queue the bodies are not read from disk (unless cached already).
        """
        return self._collect(start, end, self._record_properties)

    def _collect(self, start: int, end: int, reader) -> list[MessageBatch]:
        out: list[MessageBatch] = []
        i = self._segment_at(start)
        for seg in self.segments[i:]:
            if seg.base_offset >= end:
                break
            if seg.end_offset <= start:
                continue
            k = max(0, seg.record_index(start))
            while k < len(seg.firsts) and seg.firsts[k] < end:
                rec = reader(seg, k)
                if rec is None:  # a transient record freed once all of it was acked
                    k += 1
                    continue
                lo, hi = max(start, rec.first_offset), min(end, rec.end_offset)
                if hi > lo:
                    out.append(rec.slice(lo - rec.first_offset, hi - rec.first_offset))
                k += 1
        return out

    def _record_properties(self, seg: Segment, k: int) -> MessageBatch | None:
        if seg.fd is None:
            return seg.batches[k]
        rec = self._cache.get((seg.base_offset, k))
        return rec if rec is not None else seg.read_properties(k)

    def segment_of(self, offset: int) -> Segment | None:
        """The live segment holding ``offset``, if any."""
        if not self.segments:
            return None
        seg = self.segments[self._segment_at(offset)]
        return seg if seg.base_offset <= offset < seg.end_offset else None

    def _record(self, seg: Segment, k: int) -> MessageBatch | None:
        if seg.fd is None:
            return seg.batches[k]
        key = (seg.base_offset, k)
        rec = self._cache.get(key)
        if rec is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return rec
        self.cache_misses += 1
        rec = seg.read_record(k)
        if rec is None:
            return None
        self._cache[key] = rec
        self._cache_bytes += rec.nbytes
        while self._cache_bytes > self.read_cache_bytes and len(self._cache) > 1:
            self._cache_bytes -= self._cache.popitem(last=False)[1].nbytes
        return rec

    # -- statistics and closing ------------------------------------------------------

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of live segment files."""
        return sum(s.size for s in self.segments if s.fd is not None)

    @property
    def transient_bytes(self) -> int:
        """Bytes of transient messages held in memory (not flowed to disk)."""
        return sum(s.memory_bytes for s in self.segments)

    @property
    def read_cache_used(self) -> int:
        """Bytes of records in the read cache."""
        return self._cache_bytes

    @property
    def bytes_in_memory(self) -> int:
        """Bytes of messages held in memory (transient records and the read cache)."""
        return self.transient_bytes + self._cache_bytes

    @property
    def bytes_queued(self) -> int:
        """Bytes of unacknowledged messages, in memory and on disk (estimated per
        segment from its size and the fraction of its messages still unacknowledged)."""
        total = 0
        for s in self.segments:
            if s.count:
                stored = s.memory_bytes if s.fd is None else s.size - SEGMENT_HEADER.size
                total += stored * (s.count - s.acked_n) // s.count
        return total

    @property
    def index_bytes(self) -> int:
        """Bytes of the in-memory index: per-record positions, per-message ack flags,
        property summaries (per-message metadata counts against the memory budget)."""
        total = 0
        for s in self.segments:
            total += s.index_bytes
        return total

    @property
    def segment_files(self) -> int:
        """Number of live segment files."""
        return sum(1 for s in self.segments if s.fd is not None)

    def set_read_cache_bytes(self, limit: int) -> None:
        """Change the read cache's size (bytes), evicting the least recently used."""
        self.read_cache_bytes = max(0, limit)
        while self._cache_bytes > self.read_cache_bytes and self._cache:
            self._cache_bytes -= self._cache.popitem(last=False)[1].nbytes

    def flow_to_disk(self, limit: int) -> int:
        """Write transient records to disk, newest segment first, until at most ``limit``
        bytes of them stay in memory; returns how many messages flowed.

        The newest go first because consumers reach them last. A segment is written
        whole to a file (not fsynced: transient) and its in-memory batches dropped;
        its offsets, acks and CacheReferences do not change.
        """
        flowed = 0
        for seg in reversed(self.segments):
            if self.transient_bytes <= limit:
                break
            if seg.fd is not None or seg.planned_size != seg.size or not seg.memory_bytes:
                continue
            flowed += self._write_out(seg)
        self.flowed_messages += flowed
        return flowed

    def _write_out(self, seg: Segment) -> int:
        """Turn an in-memory segment into a segment file with the same records."""
        path = os.path.join(self.directory, segment_name(seg.base_offset))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            bufs: list = [SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, seg.base_offset)]
            positions, pos = [], SEGMENT_HEADER.size
            for batch in seg.batches:
                if batch is None:  # freed (all acked): nothing to write, never read
                    positions.append(-1)
                    continue
                rec = encode_record(batch)
                positions.append(pos)
                pos += sum(memoryview(b).nbytes for b in rec)
                bufs.extend(rec)
            _pwritev_all(fd, bufs, 0)
        except OSError as exc:
            os.close(fd)
            raise StorageError(
                f"queue {self.queue!r}: flowing transient messages to {path} failed: {exc}"
            ) from exc
        messages = sum(len(b) for b in seg.batches if b is not None)
        seg.directory, seg.path, seg.fd = self.directory, path, fd
        seg.positions = array("q", positions)
        seg.size = seg.planned_size = pos
        seg.batches = []
        seg.memory_bytes = 0
        return messages

    def close(self) -> None:
        """Close every file descriptor; files stay (deleted segments' files go)."""
        self.unlink_deleted()
        for seg in self.segments:
            seg.close()
        if self._ack_log is not None:
            self._ack_log.close()
            self._ack_log = None


def _pwritev_all(fd: int, bufs: list, pos: int) -> None:
    """pwritev every buffer at ``pos``, handling short writes and IOV_MAX."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    while views:
        batch = views[:_IOV_MAX]
        n = os.pwritev(fd, batch, pos)
        pos += n
        while n:
            if n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
