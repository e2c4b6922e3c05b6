"""Flow to disk: transient (non-durable) messages over their memory limit go to files.

Qpid's flow to disk: new records go to segment files, and existing in-memory segments
are written out whole, newest first. These files are never fsynced (a transient message
promises nothing across a crash) and a non-durable queue deletes them when it opens.
"""

from __future__ import annotations

import contextlib
import os
from array import array

from raymq.storage.files import create_file, pwritev_all, storage_error
from raymq.storage.format import SEGMENT_HEADER, segment_name
from raymq.storage.record import encode_record
from raymq.storage.segment import Segment, Segments, new_salt, segment_header


class Flow:
    """When transient messages go to disk, and moving in-memory segments there."""

    def __init__(self, directory: str, queue: str, segments: Segments):
        self.directory = directory
        self.queue = queue
        self.segments = segments
        #: Bytes of transient (non-durable) messages allowed in memory; beyond it they
        #: flow to disk (Qpid). None: no limit. Durable messages are always on disk.
        self.memory_limit: int | None = None
        #: True while the last transient write went to disk because memory was full.
        self.flowing = False
        self.flowed_messages = 0  # transient messages written to disk, new or existing

    @property
    def transient_bytes(self) -> int:
        """Bytes of transient messages held in memory (not flowed to disk)."""
        return sum(s.memory_bytes for s in self.segments)

    def must_flow(self, transient_bytes: int) -> bool:
        """Should a transient record go to disk, given memory would then hold
        ``transient_bytes`` (bytes)? Also notes the decision in ``flowing``."""
        self.flowing = self.memory_limit is not None and transient_bytes > self.memory_limit
        return self.flowing

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
        salt = new_salt()
        try:
            fd = create_file(path, exclusive=False)
        except OSError as exc:
            raise storage_error(self.queue, "flowing transient messages", path, exc) from exc
        try:
            bufs: list = [segment_header(seg.base_offset, salt)]
            positions, pos = [], SEGMENT_HEADER.size
            for batch in seg.batches:
                if batch is None:  # freed (all acked): nothing to write, never read
                    positions.append(-1)
                    continue
                rec = encode_record(batch, salt, pos)
                positions.append(pos)
                pos += sum(memoryview(b).nbytes for b in rec)
                bufs.extend(rec)
            pwritev_all(fd, bufs, 0)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise storage_error(self.queue, "flowing transient messages", path, exc) from exc
        messages = sum(len(b) for b in seg.batches if b is not None)
        seg.directory, seg.path, seg.fd, seg.salt = self.directory, path, fd, salt
        seg.positions = array("q", positions)
        seg.size = seg.planned_size = pos
        seg.batches = []
        seg.memory_bytes = 0
        return messages
