"""ReplicaFiles: a follower's copy of a replicated queue's files.

A follower holds no index and no cache: it writes the bytes its leader sends to the same
files at the same positions, in the same format (docs/FORMAT.md, "Replicas"), so that
the directory is a queue directory like any other. Promoting the follower is opening
that directory as a queue: recovery reads it like the leader's own after a crash.

Three kinds of traffic arrive:

- ``apply``: one group commit of the leader (``MirrorWrite``): an ack record, records at
  their positions, maybe a checkpoint, the segment files the leader deleted. Each write
  says where it goes; one that does not continue this copy's file (a record position
  past or before its end) raises ``Diverged``, and the leader catches this copy up.
- ``truncate_to``, ``write_chunk``, ``install``: catching up. The copy is cut back to an
  offset every replica agrees on (its epoch history says which), then the leader's
  published segment bytes are copied in, and the small files (checkpoint, ack logs)
  replaced by the leader's.
- ``epochs``: the epoch history, ``(epoch, first offset)`` pairs, kept in ``epochs``.

Every write is fdatasynced before the method returns, and the directory fsynced after
a file was created or removed: what a follower answered is on its disk.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from raymq.storage.acklog import list_generations
from raymq.storage.checkpoint import checkpoint_path, stage_checkpoint
from raymq.storage.files import (
    create_file,
    create_queue_directory,
    fsync_directory,
    pwritev_all,
    write_file_atomic,
)
from raymq.storage.format import (
    ACK_PREFIX,
    CHECKPOINT_NAME,
    SEGMENT_SUFFIX,
    ack_log_name,
    segment_name,
)
from raymq.storage.scanner import scan
from raymq.storage.segment import BadSegmentHeader, parse_segment_header

#: The epoch history file of a replica directory.
EPOCHS_NAME = "epochs"
#: The newest epoch a follower was told of (it refuses older leaders, also after a
#: restart).
FENCE_NAME = "fenced-epoch"


class Diverged(Exception):
    """A leader's write does not continue this copy: it must be caught up."""


@dataclass
class MirrorWrite:
    """One group commit of a leader, as bytes at positions (docs/FORMAT.md, "Replicas")."""

    epoch: int
    #: The leader's commit number; a follower applies them in order, without gaps.
    seq: int
    #: The queue's next offset once this commit is published.
    end_offset: int
    #: One ack record (header and payload), appended to the current ack log.
    ack_record: bytes | None = None
    #: (segment file name, position, buffers): records (a new file's header first, at
    #: 0), as the leader's writer writes them (bytes-like buffers, not joined).
    records: list[tuple[str, int, list]] = field(default_factory=list)
    #: (generation, next offset, checkpoint bytes): start ack log ``generation`` and
    #: replace the checkpoint, then remove older ack logs.
    checkpoint: tuple[int, int, bytes] | None = None
    #: Segment files the leader deleted (fully acknowledged).
    deleted: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of records carried."""
        return sum(_length(bufs) for _name, _pos, bufs in self.records)

    def portable(self) -> MirrorWrite:
        """A copy whose records are each one array (a Ray argument: picklable)."""
        records = [
            (name, pos, [np.frombuffer(b"".join(bufs), dtype=np.uint8)])
            for name, pos, bufs in self.records
        ]
        return MirrorWrite(
            self.epoch,
            self.seq,
            self.end_offset,
            self.ack_record,
            records,
            self.checkpoint,
            list(self.deleted),
        )


def _length(bufs: list) -> int:
    return sum(memoryview(b).nbytes for b in bufs)


@dataclass
class MirrorState:
    """What a copy holds, for its leader to catch it up."""

    #: Its newest epoch, and the next offset after its last record.
    last_epoch: int
    end_offset: int
    #: Segment file name -> bytes.
    segments: dict[str, int]
    #: Bytes of segment files it holds.
    nbytes: int


class ReplicaFiles:
    """A follower's queue directory."""

    def __init__(self, directory: str, queue: str):
        self.directory = directory
        self.queue = queue
        create_queue_directory(directory)
        self._fds: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        for name in os.listdir(directory):
            if name.endswith(SEGMENT_SUFFIX):
                self.sizes[name] = os.path.getsize(os.path.join(directory, name))
        gens = list_generations(directory)
        self.ack_generation = gens[-1] if gens else 0
        self.epochs: list[tuple[int, int]] = read_epochs(directory)
        self.end_offset = self._scan_end()
        self.seq = -1  # the last commit applied since this copy was caught up

    # -- state -----------------------------------------------------------------------

    def note_epoch(self, epoch: int, start: int) -> None:
        """Record that ``epoch`` starts at offset ``start`` (durably), if it is new."""
        if not self.epochs or epoch > self.epochs[-1][0]:
            self.epochs.append((epoch, start))
            write_epochs(self.directory, self.epochs)

    def read_fence(self) -> int:
        """The newest epoch this copy was told of (0: none)."""
        try:
            with open(os.path.join(self.directory, FENCE_NAME), "rb") as f:
                return int(json.loads(f.read()))
        except (OSError, ValueError):
            return 0

    def write_fence(self, epoch: int) -> None:
        """Record durably that this copy refuses leaders of epochs before ``epoch``."""
        write_file_atomic(os.path.join(self.directory, FENCE_NAME), json.dumps(epoch).encode())

    @property
    def last_epoch(self) -> int:
        """The newest epoch this copy holds records or state of (0: none)."""
        return self.epochs[-1][0] if self.epochs else 0

    def _segment_bases(self) -> list[int]:
        return sorted(int(n[: -len(SEGMENT_SUFFIX)]) for n in self.sizes)

    def _scan_end(self) -> int:
        """The next offset after the last valid record of the newest segment."""
        bases = self._segment_bases()
        while bases:
            base = bases.pop()
            records, _valid_end = self._records_of(base)
            if records:
                first, count, _pos = records[-1]
                return first + count
            return base
        return 0

    def _records_of(self, base: int) -> tuple[list[tuple[int, int, int]], int]:
        """(first offset, count, position) of each valid record of a segment, and
        where its valid bytes end (0: not even a header)."""
        path = os.path.join(self.directory, segment_name(base))
        with open(path, "rb") as f:
            data = f.read()
        try:
            salt, version = parse_segment_header(data, base, path)
        except BadSegmentHeader:
            return [], 0
        from raymq.storage.format import SEGMENT_HEADER, SEGMENT_HEADER_V1

        start = SEGMENT_HEADER.size if version >= 2 else SEGMENT_HEADER_V1.size
        result = scan(data, start, salt=salt, expected=base)
        if result.damaged:  # keep only what precedes the first damage
            cut = result.damaged[0].start
            kept = [r for r in result.records if r[2] < cut]
            return kept, cut
        return result.records, result.valid_end

    def state(self) -> MirrorState:
        """What this copy holds."""
        return MirrorState(
            self.last_epoch, self.end_offset, dict(self.sizes), sum(self.sizes.values())
        )

    # -- applying a leader's commits -------------------------------------------------

    def _fd(self, name: str, *, create: bool) -> int:
        fd = self._fds.get(name)
        if fd is None:
            path = os.path.join(self.directory, name)
            fd = create_file(path, exclusive=False) if create else os.open(path, os.O_RDWR)
            self._fds[name] = fd
            if create and name.endswith(SEGMENT_SUFFIX):
                # Known from its creation: a write into it that fails leaves a file a
                # cut or an install must remove (found by the simulator: kept unknown,
                # it outlived them, and a promoted copy served its stale record).
                self.sizes.setdefault(name, 0)
        return fd

    def apply(self, write: MirrorWrite) -> None:
        """Write one commit of the leader durably. Raises ``Diverged`` (having written
        nothing of its records) if it does not continue this copy, ``OSError`` if the
        disk fails."""
        if self.seq >= 0 and write.seq != self.seq + 1:
            raise Diverged(f"commit {write.seq} after {self.seq}")
        for name, pos, _bufs in write.records:
            have = self.sizes.get(name)
            if (have is None and pos != 0) or (have is not None and have != pos):
                raise Diverged(f"{name}: a record at {pos}, the copy has {have} bytes")
        created = False
        if write.ack_record is not None:
            try:
                fd = self._fd(ack_log_name(self.ack_generation), create=False)
            except FileNotFoundError:
                missing = ack_log_name(self.ack_generation)
                raise Diverged(f"no {missing} to append acks to") from None
            os.lseek(fd, 0, os.SEEK_END)
            os.write(fd, write.ack_record)
            os.fdatasync(fd)
        touched: dict[str, int] = {}
        for name, pos, bufs in write.records:
            created |= name not in self.sizes
            fd = self._fd(name, create=name not in self.sizes)
            pwritev_all(fd, bufs, pos)
            self.sizes[name] = pos + _length(bufs)
            touched[name] = fd
        for fd in touched.values():
            os.fdatasync(fd)
        if write.checkpoint is not None:
            self._checkpoint(*write.checkpoint)
        for name in write.deleted:
            created |= self._unlink(name)
        if created:
            fsync_directory(self.directory)
        self.note_epoch(write.epoch, self.end_offset)
        self.end_offset = max(self.end_offset, write.end_offset)
        self.seq = write.seq

    def _checkpoint(self, generation: int, next_offset: int, data: bytes) -> None:
        """As the leader's writer: start ack log ``generation``, replace the
        checkpoint, remove older ack logs."""
        from raymq.storage.acklog import AckLog

        self._close(ack_log_name(generation))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, ack_log_name(generation)))
        log = AckLog(self.directory, generation)
        log.create(next_offset)
        log.close()
        path = stage_checkpoint(self.directory, data)
        os.replace(path, checkpoint_path(self.directory))
        fsync_directory(self.directory)
        self.ack_generation = generation
        for gen in list_generations(self.directory):
            if gen < generation:
                self._unlink(ack_log_name(gen))

    def _close(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def _unlink(self, name: str) -> bool:
        # Forgotten once gone: a failed unlink leaves it known (a later cut or install
        # removes it again, instead of leaving it to come back at the next open).
        self._close(name)
        path = os.path.join(self.directory, name)
        try:
            os.unlink(path)
            removed = True
        except FileNotFoundError:
            removed = False
        except OSError:
            if not os.path.exists(path):  # it failed after the name was gone
                self.sizes.pop(name, None)
            raise
        self.sizes.pop(name, None)
        return removed

    # -- catching up -----------------------------------------------------------------

    def truncate_to(self, offset: int) -> None:
        """Cut this copy back to its valid records before ``offset`` (a record boundary
        every replica agrees on): later segment files removed, the one holding it cut
        at it (a torn or stale tail goes too); a file left with no record goes whole
        (its header may not be the leader's). Only that one file is read. Its commit
        sequence is forgotten: it is caught up from here."""
        self.seq = -1
        bases = self._segment_bases()
        for base in bases:
            if base >= offset:
                self._unlink(segment_name(base))
        below = [b for b in bases if b < offset]
        if below:  # the only file that can hold ``offset`` or a torn tail
            name = segment_name(below[-1])
            records, valid_end = self._records_of(below[-1])
            kept = [r for r in records if r[0] + r[1] <= offset]
            keep = valid_end if len(kept) == len(records) else records[len(kept)][2]
            if not kept:
                self._unlink(name)
            else:
                self._cut_file(name, keep)
        # Always: an earlier cut whose directory sync failed removed names that a
        # crash could bring back (records the leader gave other messages to).
        fsync_directory(self.directory)
        self.end_offset = min(self._scan_end(), offset)
        self.epochs = [(e, s) for e, s in self.epochs if s < self.end_offset or s == 0]

    def _cut_file(self, name: str, size: int) -> None:
        """Make segment ``name`` end at ``size`` bytes on disk, durably. The file may be
        longer than this copy counts (a write that failed after its bytes landed):
        found by the simulator, such a stale tail outlived cuts and installs, and a
        promoted copy served its records."""
        if os.path.getsize(os.path.join(self.directory, name)) != size:
            fd = self._fd(name, create=False)
            os.ftruncate(fd, size)
            os.fdatasync(fd)
        self.sizes[name] = size

    def write_chunk(self, name: str, pos: int, data: np.ndarray, *, sync: bool) -> None:
        """Copy ``data`` of the leader's segment ``name`` to ``pos`` (which must be
        where this copy's file ends); fdatasync it when ``sync``."""
        have = self.sizes.get(name, 0)
        if have != pos:
            raise Diverged(f"{name}: a chunk at {pos}, the copy has {have} bytes")
        fd = self._fd(name, create=name not in self.sizes)
        pwritev_all(fd, [data], pos)
        self.sizes[name] = pos + len(data)
        if sync:
            os.fdatasync(fd)

    def install(
        self,
        segments: dict[str, int],
        small_files: dict[str, bytes],
        epochs: list[tuple[int, int]],
        end_offset: int,
        seq: int,
    ) -> None:
        """Finish catching up: this copy's segments must be the leader's ``segments``
        (name -> bytes; others are removed), its ack logs and checkpoint become
        ``small_files``, its epoch history ``epochs``; from now on it takes the
        leader's commits after ``seq``."""
        for name, size in segments.items():
            if self.sizes.get(name) != size:
                raise Diverged(f"{name}: {self.sizes.get(name)} bytes, the leader has {size}")
            self._cut_file(name, size)
        for name, fd in list(self._fds.items()):
            if name.endswith(SEGMENT_SUFFIX):
                os.fdatasync(fd)
        # The leader's segments durable, names included, before any other goes: a
        # crash in between leaves every record this copy had or was sent (found by
        # the simulator: removed first, records it had acknowledged were lost).
        fsync_directory(self.directory)
        # Stale ack logs go first (one of a later generation than the leader's
        # checkpoint would be read at recovery: its acks are of other messages); then
        # the leader's small files; only then the segments the leader deleted (all
        # acknowledged). At a crash anywhere, the copy's next offset (the larger of
        # its segments' end and its checkpoint's) never goes back: found by the
        # simulator (seed 2605599 of its replicated mode), a crash after the segments
        # went and before the checkpoint came left a copy ending 7 offsets short of
        # what it had acknowledged, with its old checkpoint.
        for name in os.listdir(self.directory):
            if name.startswith(ACK_PREFIX) and name not in small_files:
                self._unlink(name)
        fsync_directory(self.directory)
        for name, data in small_files.items():
            self._close(name)
            write_file_atomic(os.path.join(self.directory, name), data)
        if CHECKPOINT_NAME not in small_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, CHECKPOINT_NAME))
        on_disk = {n for n in os.listdir(self.directory) if n.endswith(SEGMENT_SUFFIX)}
        for name in sorted(on_disk | set(self.sizes)):
            if name not in segments:
                self._unlink(name)
        fsync_directory(self.directory)
        gens = list_generations(self.directory)
        self.ack_generation = gens[-1] if gens else 0
        self.epochs = [tuple(p) for p in epochs]
        write_epochs(self.directory, self.epochs)
        self.end_offset = end_offset
        self.seq = seq

    def close(self) -> None:
        """Close every file."""
        for name in list(self._fds):
            self._close(name)


def read_small_files(directory: str) -> dict[str, bytes]:
    """The checkpoint and ack logs of a queue directory, by name (a follower's
    ``install``)."""
    out: dict[str, bytes] = {}
    for name in sorted(os.listdir(directory)):
        if name == CHECKPOINT_NAME or (name.startswith(ACK_PREFIX) and name.endswith(".log")):
            with (
                contextlib.suppress(FileNotFoundError),
                open(os.path.join(directory, name), "rb") as f,
            ):
                out[name] = f.read()
    return out


def read_range(path: str, start: int, end: int) -> np.ndarray:
    """Bytes [start, end) of a file, as a uint8 array (shipped without a copy)."""
    out = np.empty(end - start, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < len(out):
            n = os.preadv(fd, [memoryview(out)[got:]], start + got)
            if n <= 0:
                raise OSError(f"{path}: short read at {start + got}")
            got += n
    finally:
        os.close(fd)
    return out


def read_epochs(directory: str) -> list[tuple[int, int]]:
    """A queue directory's epoch history (empty if it has none)."""
    path = os.path.join(directory, EPOCHS_NAME)
    try:
        with open(path, "rb") as f:
            return [tuple(pair) for pair in json.loads(f.read())]
    except (OSError, ValueError):
        return []


def write_epochs(directory: str, epochs: list[tuple[int, int]]) -> None:
    """Write a queue directory's epoch history atomically and durably."""
    write_file_atomic(
        os.path.join(directory, EPOCHS_NAME), json.dumps([list(p) for p in epochs]).encode()
    )


def end_of_epoch(epochs: list[tuple[int, int]], epoch: int, end_offset: int) -> int:
    """Where ``epoch``'s records end in a log with history ``epochs`` and next offset
    ``end_offset``: the start of the first later epoch (Kafka's leader-epoch rule), or
    the log's end if none is later."""
    for e, start in epochs:
        if e > epoch:
            return start
    return end_offset


def mirror_write(prepared, deleted: list[str], end_offset: int) -> MirrorWrite:
    """The ``MirrorWrite`` of a leader's prepared group commit (``writer.PreparedWrite``):
    the bytes its ``write`` puts where it puts them. ``deleted``: segment files deleted
    since the last one; ``end_offset``: the next offset once it is published. Epoch and
    sequence number are the leader's to fill in."""
    from raymq.storage.acklog import encode_ack_record
    from raymq.storage.writer import by_segment

    out = MirrorWrite(epoch=0, seq=0, end_offset=end_offset, deleted=list(deleted))
    if prepared.ack_ranges is not None and prepared.ack_log is not None:
        header, payload = encode_ack_record(
            prepared.ack_ranges, prepared.ack_high, prepared.subscription_ranges
        )
        out.ack_record = header + payload
    if prepared.records_error is None:
        new = {id(s) for s in prepared.new_segments}
        for seg, pos, bufs in by_segment(prepared.items):
            if not bufs:
                continue
            if id(seg) in new:
                bufs, pos = [seg.file_header(), *bufs], 0
            out.records.append((os.path.basename(seg.path), pos, list(bufs)))
    if prepared.checkpoint is not None:
        out.checkpoint = (prepared.checkpoint_generation, prepared.ack_high, prepared.checkpoint)
    return out
