"""Recovery: rebuild a durable queue's state from its files, and report what it found.

Kafka's LogLoader and LevelDB's log reader are the models: recovery never guesses, it
reports every byte it dropped and why. docs/FORMAT.md, "Recovery", lists the rules:

- only the unsynced tail of the newest segment can be torn by a crash (the writer
  fdatasyncs each segment before it writes the next one), and only if nothing durable
  says its offsets were published (the checkpoint's next offset and the ack logs' high
  water): such a tail is cut off and its bytes counted in ``truncated_bytes``;
- anything else that fails its checks is *damage*: its messages are counted in
  ``lost_messages`` (unless already acknowledged) and never served, its bytes are copied
  aside to ``<segment file>.damaged-<position>`` (a segment whose header is bad is moved
  aside whole to ``<segment file>.damaged``);
- offsets are never given again: the next offset is the highest that the checkpoint,
  the ack logs or the segments know of.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from raymq.storage.ack_ranges import AckRanges
from raymq.storage.ack_state import AckState
from raymq.storage.acklog import (
    AckLog,
    AckLogContents,
    deliveries_as_ranges,
    list_generations,
    read_ack_log,
)
from raymq.storage.checkpoint import (
    duplicate_id_entries,
    encode_checkpoint,
    read_checkpoint,
    restore_segment,
    subscription_sections,
    write_checkpoint,
)
from raymq.storage.duplicate_ids import segment_ids, stored_ids
from raymq.storage.files import copy_aside, fsync_directory, release_reserved, remove_file
from raymq.storage.format import (
    CHECKPOINT_NAME,
    DAMAGED_SUFFIX,
    RECORD_HEADER,
    SEGMENT_SUFFIX,
    ack_log_name,
    segment_name,
)
from raymq.storage.scanner import ScanResult, crash_explains_tail, scan
from raymq.storage.segment import (
    BadSegmentHeader,
    Segment,
    Segments,
    parse_segment_header,
    record_time,
)

#: Above this many offsets, a lost range is counted whole (not checked against acks).
_EXACT_COUNT_MAX = 50_000_000


@dataclass
class RecoveryReport:
    """What opening a queue's files found and repaired."""

    queue: str
    segments: int = 0
    depth: int = 0
    next_offset: int = 0
    used_checkpoint: bool = False
    #: Bytes of torn tails cut off (a crash during a write that never returned).
    truncated_bytes: int = 0
    #: Messages lost to damage (not acknowledged before): in live segments, including
    #: those a previous run found, and in files moved aside by this recovery.
    lost_messages: int = 0
    damage: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: Of ``lost_messages``, those this recovery found.
    damaged: int = 0
    #: Files holding damaged bytes copied aside for inspection by this recovery.
    kept_aside: list[str] = field(default_factory=list)


@dataclass
class Recovered:
    """Where the writer continues after recovery."""

    next_offset: int
    ack_log: AckLog
    ack_generation: int
    #: Files of deleted segments that could not be unlinked (yet).
    undeleted: list[str] = field(default_factory=list)
    #: An address's acknowledged ranges per subscription id (the checkpoint's and the
    #: ack logs'); None for a queue.
    subscription_ranges: dict[int, AckRanges] | None = None
    #: An address's filters are applied again from this offset: routing decided after
    #: the checkpoint's ``routed_to``, or in ack records lost to damage, may not be on
    #: disk (``next_offset`` if nothing needs it).
    route_from: int = 0
    #: What recovery left for the log's first checkpoint (``recover(defer=True)``, and
    #: damage found): None if it did it all.
    deferred: Deferred | None = None
    #: The checkpoint's remembered producer ids: (id, offset, seconds since the epoch).
    duplicate_ids: list[tuple[str, int, float]] = field(default_factory=list)
    #: The producer ids in the live segments stored since ``recover``'s ``ids_since_us``.
    stored_ids: list[tuple[str, int, float]] = field(default_factory=list)
    #: offset -> due (µs since the epoch) of unacknowledged messages nacked with a delay.
    delays: dict[int, int] = field(default_factory=dict)
    #: offset -> deliveries so far of unacknowledged messages delivered before.
    deliveries: dict[int, int] = field(default_factory=dict)


@dataclass
class Deferred:
    """The steps of recovery that would hide the damage it found from the next one,
    left for the log's first checkpoint: an address may still fail to open after
    recovery (settling its subscriptions), and the next recovery must then find, and
    count, the same damage again (docs/FORMAT.md, "Recovery", step 6)."""

    #: Segment files with a bad header, renamed to ``<file>.damaged`` just before that
    #: checkpoint (one it does not list, below its next offset, would be removed unread).
    aside: list[str]
    #: (segment, position) of damaged ends, cut off once that checkpoint is durable.
    cuts: list[tuple[Segment, int]]
    #: The checkpoint's subscription section and ``routed_to`` as recovery found them,
    #: for a checkpoint taken before the address's subscriptions are attached.
    sections: dict[int, bytes] | None
    routed_to: int

    def move_aside(self) -> OSError | None:
        """Rename the files with a bad header (one renamed already is skipped), then
        fsync the directory; returns that fsync's error, if any: the renames may then
        not be durable, and no checkpoint may follow (one that reached the disk without
        them would have the next recovery remove those files unread). Raises
        ``OSError`` if a rename fails."""
        for path in self.aside:
            if os.path.exists(path) or not os.path.exists(path + DAMAGED_SUFFIX):
                os.replace(path, path + DAMAGED_SUFFIX)
        if self.aside:
            try:
                fsync_directory(os.path.dirname(self.aside[0]))
            except OSError as exc:
                return exc
        return None

    def cut(self) -> None:
        """Cut the damaged ends off, once a durable checkpoint records them. A segment
        cut becomes appendable again (a version-2 file); one whose cut fails keeps its
        damaged bytes and is never written over."""
        for seg, tail in self.cuts:
            if seg.fd is None:  # deleted meanwhile (fully acknowledged)
                continue
            try:
                os.ftruncate(seg.fd, tail)
                os.fsync(seg.fd)
            except OSError:
                continue
            seg.appendable = seg.salt is not None


@dataclass
class _SegmentFile:
    base: int
    size: int
    #: A later segment file has bytes, so this one was fully synced before those.
    sealed: bool
    next_base: int | None


class Loader:
    """Recovers one durable queue directory into ``segments`` and ``acks``."""

    def __init__(self, directory: str, segments: Segments, acks: AckState, report: RecoveryReport):
        self.directory = directory
        self.segments = segments
        self.acks = acks
        self.report = report
        #: Highest next offset that durable state (checkpoint, ack logs) knows was given.
        self._durable_high = 0
        self._floor = 0  # offsets below this were given (moved-aside files)
        self._lost: list[tuple[Segment, int, int]] = []
        self._lost_whole: list[tuple[int, int]] = []
        self._cuts: list[tuple[Segment, int]] = []  # damaged tails, cut after the checkpoint
        self._aside: list[str] = []  # files with a bad header, moved aside at the end
        self._scanned_from = 2**63 - 1  # lowest offset of a record read past the checkpoint
        self._undeleted: list[str] = []

    def recover(self, *, defer: bool = False, ids_since_us: int | None = None) -> Recovered:
        """Read the checkpoint and the ack logs, scan the segments, apply the acks, then
        delete what is fully acknowledged and start a new ack generation with a
        checkpoint written at once.

        ``defer`` (an address: its open can still fail after this, while its
        subscriptions are settled): if damage was found, what would hide it from the
        next recovery (renaming files with a bad header, the checkpoint, cutting
        damaged ends) is left to the log's first checkpoint (``Recovered.deferred``).

        ``ids_since_us`` (µs since the epoch; None: none): the producer ids stored since
        then in the live segments are read too (``Recovered.stored_ids``), before the
        damage is settled: reading them can fail, and a recovery that fails must leave
        its damage for the next one to find and count (found by the fault simulator)."""
        ckpt, logs, next_generation = self._read_durable_state()
        self._duplicate_ids = duplicate_id_entries(ckpt)
        self._load_segments(ckpt)
        for contents in logs.values():
            self.acks.apply_ranges(contents.ranges)
        self._delays = self._delays_left(ckpt, logs)
        self._deliveries = self._deliveries_left(ckpt, logs)
        self._count_lost(np.concatenate([a.ranges for a in logs.values()]) if logs else None)
        last_end = self.segments[-1].end_offset if self.segments else 0
        next_offset = max(self._durable_high, self._floor, last_end, self._moved_aside_floor())
        self.acks.recount()
        self._delete_fully_acked()
        subscriptions = self._subscription_ranges(ckpt, logs)
        route_from = self._route_from(ckpt, logs, next_offset)
        sections = None
        if subscriptions is not None:  # the ack logs about to go held some of them
            sections = {sid: r.to_bytes() for sid, r in subscriptions.items()}
        deferred = Deferred(self._aside, self._cuts, sections, route_from)
        defer = defer and bool(self.report.damaged or self._aside or self._cuts)
        if defer:  # a file with a bad header keeps its name a while: no new one takes it
            next_offset = max([next_offset, *(base + 1 for base, _ in self._lost_whole)])
        ack_log = self._start_ack_log(next_generation, next_offset, logs)
        got = Recovered(
            next_offset, ack_log, ack_log.generation, self._undeleted, subscriptions, route_from
        )
        got.duplicate_ids = self._duplicate_ids
        if ids_since_us is not None:
            got.stored_ids = stored_ids(self.segments, ids_since_us)
        got.delays = self._delays
        got.deliveries = self._deliveries
        for seg, _tail in self._cuts:
            seg.appendable = False  # the damaged bytes stay until cut: never write over them
        # Only now (a full disk fails recovery above) may damage be hidden from the next
        # recovery: one that fails before must find, and count, the damage again. An
        # address can still fail to open after this: it leaves that to its first
        # checkpoint.
        if defer:
            got.deferred = deferred
            return got
        self._settle_damage(deferred, next_offset, ack_log.generation)
        return got

    def _read_durable_state(self) -> tuple[dict | None, dict[int, AckLogContents], int]:
        """The checkpoint (None if there is none or it is damaged: reported), the ack
        logs from its generation on (by generation) and the generation the next ack log
        takes (past every one found); sets the next offsets they say were given
        (``_durable_high``, ``_checkpoint_next``)."""
        ckpt, damage = read_checkpoint(self.directory)
        if damage:
            self.report.damage.append(damage)
        self.report.used_checkpoint = ckpt is not None
        first_gen = ckpt["ack_generation"] if ckpt else 0
        generations = list_generations(self.directory)
        logs = self._read_ack_logs([g for g in generations if g >= first_gen])
        self._durable_high = max(
            [ckpt["next_offset"] if ckpt else 0, *(a.high for a in logs.values())]
        )
        self._checkpoint_next = ckpt["next_offset"] if ckpt else 0
        return ckpt, logs, max([first_gen, *generations]) + 1

    def _delays_left(self, ckpt: dict | None, logs: dict[int, AckLogContents]) -> dict[int, int]:
        """offset -> due (µs since the epoch) of each unacknowledged message nacked with
        a delay: the checkpoint's, then the ack logs' in order (a later nack's delay
        replaces an earlier one's)."""
        due: dict[int, int] = {int(o): int(t) for o, t in (ckpt or {}).get("delayed", ())}
        for contents in logs.values():
            for due_us, ranges in contents.delays:
                for start, end in ranges.tolist():
                    due.update(dict.fromkeys(range(start, end), due_us))
        if due:
            offsets = np.fromiter(due, dtype=np.int64, count=len(due))
            for o in offsets[self.acks.is_acked(offsets)].tolist():
                del due[o]
        return due

    def _deliveries_left(
        self, ckpt: dict | None, logs: dict[int, AckLogContents]
    ) -> dict[int, int]:
        """offset -> deliveries so far of each unacknowledged message delivered: the
        checkpoint's counts, then the ack logs' in order, the latest count of an offset
        winning. Read newest first, so that each offset is decided once (most were
        acknowledged since: only the few left are expanded)."""
        sections = [
            (int(n), np.frombuffer(r, dtype="<i8").reshape(-1, 2))
            for n, r in (ckpt or {}).get("delivered", ())
        ]
        for contents in logs.values():
            sections.extend(contents.deliveries)
        counts: dict[int, int] = {}
        decided = AckRanges()
        for count, ranges in reversed(sections):
            fresh = [decided.gaps(s, e, e - s) for s, e in ranges.tolist() if e > s]
            decided.add_ranges(ranges)
            if not fresh:
                continue
            offsets = np.concatenate(fresh)
            offsets = offsets[~self.acks.is_acked(offsets)]
            if count > 0:
                counts.update(dict.fromkeys(offsets.tolist(), count))
        return counts

    def _delete_fully_acked(self) -> None:
        """Delete the segments whose every message is acknowledged (their acks are
        durable in the ack logs), except the newest and those holding lost offsets."""
        # The newest stays (its name keeps the highest offset: see Writer._deletable). One
        # holding lost offsets stays too, for the running log to delete: deleted here,
        # a recovery that then fails would leave the next one nothing to count.
        for seg in list(self.segments)[:-1]:
            if seg.fully_acked and not seg.lost_n:
                # Producer ids stored in it may be in no checkpoint yet: they go on in
                # the next one (the queue keeps those within its dedup_window_s).
                self._duplicate_ids.extend(segment_ids(seg))
                self.segments.remove(seg)  # acks durable in the ack logs: delete first (room)
                self._delete(seg)

    def _settle_damage(self, deferred: Deferred, next_offset: int, generation: int) -> None:
        """Hide the damage found from the next recovery, once the rest of this one has
        succeeded: move the files with a bad header aside, write the checkpoint
        (``next_offset``, ack ``generation``), then cut the damaged ends it records. No
        checkpoint if the renames may not be durable (reported: a later one is taken)."""
        unsynced = deferred.move_aside()
        if unsynced is not None:
            self.report.damage.append(
                f"{self.directory}: no checkpoint written at recovery ({unsynced}); the next"
                " one will be"
            )
        elif self._checkpoint(next_offset, generation, deferred.sections, deferred.routed_to):
            deferred.cut()

    def _load_segments(self, ckpt: dict | None) -> None:
        saved = {s["base"]: s for s in ckpt["segments"]} if ckpt else {}
        deleted = set(ckpt.get("deleted", ())) if ckpt else set()
        for f in self._segment_files():
            # A checkpoint lists every live segment below its next offset: one it does
            # not list was deleted before it (fully acknowledged), and is back because
            # its unlink never reached the disk while the checkpoint's rename did.
            forgotten = ckpt is not None and f.base not in saved and f.base < ckpt["next_offset"]
            if f.base in deleted or forgotten:
                self._remove_deleted(f.base)
                continue
            seg = self._recover_segment(f, saved.get(f.base))
            if seg is not None:
                self.segments.append(seg)

    def _moved_aside_floor(self) -> int:
        """Past the offsets whole segment files moved aside (``<base>.seg.damaged``)
        could hold: their names keep offsets from being given again even when the
        checkpoint and the ack logs are damaged too."""
        floor = 0
        suffix = SEGMENT_SUFFIX + DAMAGED_SUFFIX
        for name in os.listdir(self.directory):
            if name.endswith(suffix) and name[: -len(suffix)].isdigit():
                size = os.path.getsize(os.path.join(self.directory, name))
                floor = max(floor, int(name[: -len(suffix)]) + _most(size))
        return floor

    @staticmethod
    def _subscription_ranges(
        ckpt: dict | None, logs: dict[int, AckLogContents]
    ) -> dict[int, AckRanges] | None:
        """An address's acknowledged ranges per subscription id: the checkpoint's and
        the replayed ack logs' (None for a queue: none of either)."""
        sections = subscription_sections(ckpt)
        if not sections and not any(c.subscriptions for c in logs.values()):
            return None
        out = {sid: AckRanges.from_bytes(data) for sid, data in sections.items()}
        for contents in logs.values():
            for sid, ranges in contents.subscriptions.items():
                out.setdefault(sid, AckRanges()).add_ranges(ranges)
        return out

    def _route_from(
        self, ckpt: dict | None, logs: dict[int, AckLogContents], next_offset: int
    ) -> int:
        """Where an address's filters must be applied again: from the lowest record read
        past the checkpoint, or the checkpoint's ``routed_to`` if lower; from 0 when ack
        records were lost to damage (the routing in them with them)."""
        if any(c.skipped for c in logs.values()):
            return 0
        routed_to = None if ckpt is None else ckpt.get("routed_to")
        return min(self._scanned_from, next_offset if routed_to is None else routed_to, next_offset)

    def _checkpoint(
        self,
        next_offset: int,
        generation: int,
        sections: dict[int, bytes] | None,
        route_from: int,
    ) -> bool:
        """Write the checkpoint at once and delete the ack logs it makes obsolete; False
        if it could not be written."""
        undeleted = [int(os.path.basename(p)[: -len(SEGMENT_SUFFIX)]) for p in self._undeleted]
        data = encode_checkpoint(
            self.segments,
            next_offset,
            generation,
            undeleted,
            sections,
            route_from,
            self._duplicate_ids,  # kept: only the producers' resends bring them back
            sorted(self._delays.items()),
            deliveries_as_ranges(self._deliveries),
        )
        try:
            write_checkpoint(self.directory, data)
        except OSError as exc:  # the older checkpoint and ack logs stay valid
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, CHECKPOINT_NAME + ".tmp"))
            self.report.damage.append(
                f"{self.directory}: no checkpoint written at recovery ({exc}); the next one will be"
            )
            return False
        for gen in list_generations(self.directory):
            if gen < generation:  # (one that stays is replayed again, harmlessly)
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, ack_log_name(gen)))
        return True

    def _start_ack_log(
        self, generation: int, next_offset: int, logs: dict[int, AckLogContents]
    ) -> AckLog:
        """A fresh ack log generation (so that recovery starts from a clean file), or,
        if it cannot be started (a full disk), the newest one, appended to again."""
        ack_log = AckLog(self.directory, generation)
        try:
            ack_log.create(next_offset)
            return ack_log
        except OSError as exc:
            usable = [g for g, contents in logs.items() if contents.header_ok]
            if not usable:
                if exc.errno != errno.ENOSPC:
                    raise
                return self._start_ack_log_on_a_full_disk(ack_log, next_offset, logs, exc)
            gen = max(usable)
            self.report.damage.append(
                f"{ack_log.path}: cannot be started ({exc}); acks go on to generation {gen}"
            )
            return AckLog.reopen(self.directory, gen, logs[gen].end)

    def _start_ack_log_on_a_full_disk(
        self, ack_log: AckLog, next_offset: int, logs: dict[int, AckLogContents], exc: OSError
    ) -> AckLog:
        """No ack log can be appended to (a damaged header) and the disk is full: the
        room reserved for the older ones (read already; the next checkpoint retires
        them) is freed for the new one, which reserves what it can. Without this, a
        queue whose disk filled while it was down did not open."""
        freed = [g for g in logs if release_reserved(os.path.join(self.directory, ack_log_name(g)))]
        try:
            ack_log.create(next_offset, strict=False)
        except OSError:
            raise exc from None
        self.report.damage.append(
            f"{ack_log.path}: started on a full disk ({exc}) in the room reserved for "
            f"ack log generations {sorted(freed)}"
        )
        return ack_log

    def _delete(self, seg: Segment) -> None:
        """Close and unlink a segment nobody needs; if the unlink fails, the checkpoint
        names it so that a later recovery removes it."""
        seg.close()
        exc = remove_file(seg.path)
        if exc is not None:
            self._undeleted.append(seg.path)
            self.report.damage.append(f"{seg.path}: cannot be removed ({exc})")

    def _remove_deleted(self, base: int) -> None:
        """A segment deleted (fully acknowledged) whose unlink had failed: remove it
        unread (its acks may be in ack logs no longer replayed)."""
        path = os.path.join(self.directory, segment_name(base))
        exc = remove_file(path)
        if exc is not None:
            self._undeleted.append(path)
            self.report.damage.append(f"{path}: deleted segment still cannot be removed ({exc})")

    def _read_ack_logs(self, generations: list[int]) -> dict[int, AckLogContents]:
        logs = {}
        for gen in generations:
            contents = read_ack_log(os.path.join(self.directory, ack_log_name(gen)))
            self.report.damage.extend(contents.damage)
            logs[gen] = contents
        return logs

    def _segment_files(self) -> list[_SegmentFile]:
        bases = segment_bases(self.directory)
        sizes = [os.path.getsize(os.path.join(self.directory, segment_name(b))) for b in bases]
        files, later_bytes = [], False
        for i in reversed(range(len(bases))):
            nxt = bases[i + 1] if i + 1 < len(bases) else None
            files.append(_SegmentFile(bases[i], sizes[i], later_bytes, nxt))
            later_bytes = later_bytes or sizes[i] > 0
        return files[::-1]

    # -- one segment -----------------------------------------------------------------

    def _recover_segment(self, f: _SegmentFile, saved: dict | None) -> Segment | None:
        try:
            seg, data = _open_mapped(self.directory, f.base)
        except BadSegmentHeader as exc:
            self._bad_header(f, exc)
            return None
        seg.summary = None  # unknown until a scan reads its properties
        start, expected = seg.header_size, f.base
        short = saved is not None and saved["size"] > len(data)
        if short:  # bytes the checkpoint saw synced are gone: rescan, keep its acks
            flags = np.unpackbits(np.frombuffer(saved["acked"], np.uint8), count=saved["count"])
            seg.set_acked(flags.astype(np.bool_), 0)
        elif saved is not None:
            restore_segment(seg, saved)
            seg.index_times(data)
            start, expected = saved["size"], seg.end_offset
        result = scan(data, start, salt=seg.salt, expected=expected)
        stale = saved is not None and not short and result.records
        if stale and result.records[0][0] < self._checkpoint_next:
            self._unpublished(seg, saved["size"], data, result)
            data = data[: saved["size"]]
            result = scan(data, start, salt=seg.salt, expected=expected)
        regions = {region.lost[0] for region in result.damaged}
        if result.records:
            self._scanned_from = min(self._scanned_from, result.records[0][0])
        prev = expected
        for first, count, pos in result.records:
            if first > prev and prev not in regions:
                # Offsets no record holds, left by damage an earlier recovery cut off
                # (then new records were appended): never served, counted again.
                self._lost.append((seg, prev, first))
            seg.add_record(first, count, pos, record_time(data, pos))
            prev = first + count
        if short:
            end = max(f.base + saved["count"], result.end_offset)
            seg.extend_to(end)
            seg.acked_n = int(seg.acked.sum())
            if end > result.end_offset:
                self._lost.append((seg, result.end_offset, end))
            self.report.damage.append(
                f"{seg.path}: {len(data)} bytes where the checkpoint saw {saved['size']} "
                f"(offsets {result.end_offset}..{end} missing)"
            )
        for region in result.damaged:
            kept = self._keep_aside(seg, region.start, region.end)
            self._lost.append((seg, *region.lost))
            self.report.damage.append(
                f"{seg.path}: damaged bytes {region.start}..{region.end} (offsets "
                f"{region.lost[0]}..{region.lost[1]}) not served{kept}"
            )
        if result.tail is not None:
            self._tail(seg, f, result, data)
        seg.size = seg.planned_size = result.valid_end
        if seg.salt is None:
            seg.appendable = False  # version 1: new records go to a new (version 2) file
        if seg.count == 0 and not any(s is seg for s, *_ in self._lost):
            self._delete(seg)  # no records: a file created just before a crash
            return None
        return seg

    def _unpublished(self, seg: Segment, size: int, data: bytes, result: ScanResult) -> None:
        """Records after the checkpointed size of a segment with offsets below the
        checkpoint's next offset were never published (a published record is within
        its segment's checkpointed size): a failed write whose cut-back never reached
        the disk, its offsets burned. They are cut off, never served (found by the
        fault simulator)."""
        first = result.records[0][0]
        os.ftruncate(seg.fd, size)
        os.fsync(seg.fd)
        self.report.truncated_bytes += len(data) - size
        self.report.damage.append(
            f"{seg.path}: {len(data) - size} bytes of a failed write (offsets from {first})"
            f" at {size} removed"
        )

    def _tail(self, seg: Segment, f: _SegmentFile, result: ScanResult, data: bytes) -> None:
        """Bytes at the end that hold no valid record: a torn write, or damage."""
        size = len(data)
        tail, n = result.tail, size - result.tail
        claimed = max(
            result.tail_offsets[1] if result.tail_offsets else result.end_offset,
            result.tail_claimed,
        )
        published = (
            self._durable_high > result.end_offset
            or result.tail_followed
            or not crash_explains_tail(data, tail, seg.salt)  # e.g. a flipped bit
        )
        if not f.sealed and not published:
            os.ftruncate(seg.fd, tail)
            os.fsync(seg.fd)
            self.report.truncated_bytes += n
            self.report.damage.append(f"{seg.path}: torn tail of {n} bytes at {tail} truncated")
            return
        if result.tail_offsets is None and not result.tail_claimed:
            # No header to say how many messages the bytes held: as many as they could.
            claimed = result.end_offset + _most(n)
        end = f.next_base if f.sealed else max(self._durable_high, claimed)
        end = max(end, result.end_offset)
        kept = self._keep_aside(seg, tail, size)
        if kept:
            # Cut once the checkpoint is written: a recovery that fails before must
            # find (and count) the damage again, not a clean shorter file.
            self._cuts.append((seg, tail))
        else:
            seg.appendable = False  # the damaged bytes stay: never write over them
        self._lost.append((seg, result.end_offset, end))
        self.report.damage.append(
            f"{seg.path}: damaged tail of {n} bytes at {tail} (offsets {result.end_offset}.."
            f"{end}) not served{kept}"
        )

    def _bad_header(self, f: _SegmentFile, exc: BadSegmentHeader) -> None:
        path = os.path.join(self.directory, segment_name(f.base))
        if not f.sealed and self._durable_high <= f.base and exc.torn:
            # The newest file, of which nothing was ever published: its creation (or
            # first write) was torn by a crash.
            os.unlink(path)
            self.report.truncated_bytes += exc.size
            self.report.damage.append(f"{exc}; torn at creation, removed")
            return
        # The newest file's count is unknown: what its bytes could hold is never reused.
        end = f.next_base if f.sealed else max(self._durable_high, f.base + _most(exc.size))
        self._aside.append(path)
        self._lost_whole.append((f.base, end))
        self._floor = max(self._floor, end)
        self.report.kept_aside.append(path + DAMAGED_SUFFIX)
        self.report.damage.append(
            f"{exc}; offsets {f.base}..{end} not served; moved aside to {path}{DAMAGED_SUFFIX}"
        )

    def _keep_aside(self, seg: Segment, start: int, end: int) -> str:
        """Copy damaged bytes aside; returns the text for the report ("" if not kept)."""
        dest = f"{seg.path}{DAMAGED_SUFFIX}-{start}"
        if copy_aside(seg.fd, start, end, dest) or os.path.exists(dest):
            self.report.kept_aside.append(dest)
            return f"; kept in {dest}"
        return ""

    def _count_lost(self, ack_ranges: np.ndarray | None) -> None:
        """Mark the lost offsets found (after the acks: acknowledged ones are not lost)
        and count every loss."""
        damaged = sum(seg.mark_lost(start, end) for seg, start, end in self._lost)
        whole = sum(_unacked_in(start, end, ack_ranges) for start, end in self._lost_whole)
        for seg in self.segments:
            seg.planned_end = seg.end_offset
        self.report.damaged = damaged + whole
        self.report.lost_messages = sum(s.lost_n for s in self.segments) + whole


def _open_mapped(directory: str, base_offset: int) -> tuple[Segment, bytes | mmap.mmap]:
    """``Segment.open_existing`` with the file's bytes memory-mapped, not read: with a
    checkpoint, recovery scans only what lies past the checkpointed size (the header
    and, after a crash, the unsynced tail), so a clean restart touches a few pages of
    each file instead of copying every segment into memory (1 GiB of backlog took
    0.13 s and a transient gigabyte of RSS here). The map is private and read-only;
    recovery cuts a file (``ftruncate``) only after its last look at the bytes there.
    Raises ``BadSegmentHeader`` (the fd closed) as ``open_existing`` does."""
    path = os.path.join(directory, segment_name(base_offset))
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size:
            data: bytes | mmap.mmap = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ)
        else:
            data = b""  # (an empty file cannot be mapped)
        salt, version = parse_segment_header(data, base_offset, path)
    except BaseException:
        os.close(fd)
        raise
    return Segment(directory, base_offset, fd=fd, salt=salt, version=version), data


def _unacked_in(start: int, end: int, ack_ranges: np.ndarray | None) -> int:
    """Offsets of [start, end) that ``ack_ranges`` do not acknowledge."""
    if end <= start:
        return 0
    if ack_ranges is None or not len(ack_ranges) or end - start > _EXACT_COUNT_MAX:
        return end - start
    acked = np.zeros(end - start, dtype=np.bool_)
    for a, b in ack_ranges.tolist():
        lo, hi = max(a, start), min(b, end)
        if hi > lo:
            acked[lo - start : hi - start] = True
    return int((~acked).sum())


def segment_bases(directory: str) -> list[int]:
    """Base offsets of the segment files in ``directory``, ascending."""
    bases = []
    for name in os.listdir(directory):
        if name.endswith(SEGMENT_SUFFIX):
            try:
                bases.append(int(name[: -len(SEGMENT_SUFFIX)]))
            except ValueError:
                continue
    return sorted(bases)


def remove_transient_files(directory: str) -> None:
    """A non-durable queue starts empty: what flowed to disk last run is garbage."""
    for base in segment_bases(directory):
        os.unlink(os.path.join(directory, segment_name(base)))


def _most(size: int) -> int:
    """The most messages ``size`` bytes of records can hold (a record header and at
    least 24 bytes per message): an upper bound where a damaged header hides the count."""
    return max(0, size - RECORD_HEADER.size) // 24
