"""Storage faults (issue 12) against real files and real fsyncs: rot found while reading
and by the scrub, a full disk and I/O errors anywhere in the write path, offsets never
given twice whatever is damaged, and private file modes.

System calls are made to fail with ``tests.storage_helpers.Faults`` (a wrapper around
``os`` functions); the full-disk tests also run on a real 2 MiB tmpfs when this process
may mount one.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os

import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore
from raymq.errors import StorageError
from raymq.storage import SegmentLog
from raymq.storage.files import create_queue_directory
from raymq.storage.format import ACK_PREFIX, RECORD_HEADER, SEGMENT_SUFFIX, segment_name
from raymq.storage.subscriptions import (
    MANIFEST_NAME,
    Manifest,
    SubscriptionAcks,
    SubscriptionSpec,
    read_manifest,
    write_manifest,
)
from tests.storage_helpers import (
    NOW_US,
    Faults,
    batch,
    commit,
    copy_queue,
    fd_path,
    flip,
    open_fds,
    read_all,
    small_tmpfs,
    truncate,
)

PAGE = 64 * 1024


def open_log(path, page=PAGE, durable=True, queue="q"):
    return SegmentLog.open(str(path), queue=queue, page_size_bytes=page, durable=durable)


def segment_files(path) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(SEGMENT_SUFFIX))


@pytest.fixture
def faults(monkeypatch):
    return Faults(monkeypatch)


def _three_records(path, **kw):
    """A log with records of offsets 0-3, 4-7 and 8-11, checkpointed (so recovery does
    not read them again), closed; returns (segment path, position of the middle one)."""
    log, _ = open_log(path, **kw)
    for i in range(3):
        commit(log, [f"rec{i}-{j}".encode() for j in range(4)], [{"i": i}] * 4)
    commit(log, checkpoint=True)
    seg = log.segments[0]
    log.close()
    return seg.path, seg.positions[1]


# -- rot found while the queue runs --------------------------------------------------------


def test_rot_found_by_a_read_is_quarantined_and_the_rest_is_served(tmp_path, caplog):
    seg_path, pos = _three_records(tmp_path)
    flip(seg_path, pos + RECORD_HEADER.size + 20, 0xFF)
    original_size = os.path.getsize(seg_path)
    log, report = open_log(tmp_path)
    assert report.damage == []  # the checkpoint covers it: recovery does not read it
    with caplog.at_level(logging.ERROR, logger="raymq.storage"):
        batches = log.read(0, 12)  # no CorruptRecord: the rest comes back
    got = {b.first_offset + i: b.body(i) for b in batches for i in range(len(b))}
    assert sorted(got) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert log.damaged_messages == 4 and log.depth == 8
    assert log.drain_damaged().tolist() == [4, 5, 6, 7]
    assert log.drain_damaged().tolist() == []
    assert log.is_acked(np.arange(4, 8)).all()
    assert log.unacked(0, 100).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    kept = f"{seg_path}.damaged-{pos}"
    assert os.path.getsize(kept) == log.segments[0].record_end(1) - pos
    message = caplog.records[-1].getMessage()
    assert "'q'" in message and seg_path in message and "4..8" in message
    assert log.read(0, 12) and log.damaged_messages == 4  # read again: no new finding
    commit(log)  # the quarantine's acks reach the ack log
    log.close()
    assert os.path.getsize(seg_path) == original_size
    log, _ = open_log(tmp_path)
    assert sorted(read_all(log)) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert commit(log, [b"new"]) == [12]


def test_rot_found_while_open_is_quarantined(tmp_path):
    log, _ = open_log(tmp_path)
    for i in range(3):
        commit(log, [f"r{i}".encode()] * 4)
    log.set_read_cache_bytes(0)
    seg = log.segments[0]
    flip(seg.path, seg.positions[2] + RECORD_HEADER.size + 1)
    assert sorted(read_all(log)) == list(range(8))
    assert log.damaged_messages == 4 and log.drain_damaged().tolist() == [8, 9, 10, 11]


def test_rot_in_a_header_found_by_properties_is_quarantined(tmp_path):
    seg_path, pos = _three_records(tmp_path)
    flip(seg_path, pos + 17)  # the first offset field of the middle record's header
    log, _ = open_log(tmp_path)
    stored = log.properties(0, 12)
    assert [b.first_offset for b in stored] == [0, 8]
    assert log.damaged_messages == 4 and log.is_acked(np.arange(4, 8)).all()


def test_inconsistent_offset_arrays_are_found_by_properties(tmp_path):
    seg_path, pos = _three_records(tmp_path)
    # The last property offset of the middle record: a partial read cannot check it by
    # CRC, but it must add up with the record's length.
    flip(seg_path, pos + RECORD_HEADER.size + 8 * 4 + 8 * 5 + 8 * 4 + 1, 0x40)
    log, _ = open_log(tmp_path)
    assert [b.first_offset for b in log.properties(0, 12)] == [0, 8]
    assert log.drain_damaged().tolist() == [4, 5, 6, 7]


def test_scrub_finds_rot_at_a_bounded_rate(tmp_path):
    log, _ = open_log(tmp_path, page=32 * 1024)
    for i in range(10):
        commit(log, [bytes([65 + i]) * 1000] * 10)  # ~10 KB a record, 3 a segment
    log.ack(np.arange(0, 10))  # record 0: all acknowledged, never read by the scrub
    commit(log)
    bad = log.segments[2].positions[0]  # record 6
    flip(log.segments[2].path, bad + RECORD_HEADER.size + 500)
    steps = []
    while log.scrub_passes == 0:
        steps.append(log.scrub_step(15_000))
    record = 10 * 1000 + 8 * 10 + 16 * 11 + RECORD_HEADER.size
    assert all(0 < s <= 15_000 + record for s in steps[:-1])
    assert sum(steps) == 9 * record and log.scrubbed_bytes == 9 * record
    assert log.drain_damaged().tolist() == list(range(60, 70))
    assert log.damaged_messages == 10 and len(read_all(log)) == 80
    assert log.scrub_step(10**9) == 8 * record  # the next pass skips what was found
    log.close()
    log, _ = open_log(tmp_path, page=32 * 1024)
    assert sorted(read_all(log)) == [o for o in range(10, 100) if not 60 <= o < 70]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_the_scrub_reads_neighbouring_records_together_and_finds_each_damaged_one(
    tmp_path, where, monkeypatch
):
    """Small records are checked a run at a time (one read): a damaged one in the
    middle of a run is quarantined alone, the records around it are not, and the walk
    goes on after it; acknowledged records are not read."""
    log, _ = open_log(tmp_path, page=1 << 20)
    for i in range(60):
        commit(log, [bytes([65 + i % 26]) * 1000])  # one 1 KB message a record
    log.ack(np.array([0, 1, 59]))
    commit(log)
    seg = log.segments[0]
    record = seg.positions[1] - seg.positions[0]
    at = seg.positions[37] + (RECORD_HEADER.size + 200 if where == "payload" else 4)
    flip(seg.path, at)
    reads = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, pos: reads.append(n) or pread(fd, n, pos))
    steps = []
    while log.scrub_passes == 0:
        steps.append(log.scrub_step(20 * record))
    monkeypatch.undo()
    assert sum(steps) == 57 * record  # every record unacknowledged, read once
    # A read a run of up to 20 records (4 runs, one cut by the damaged record), the
    # damaged one read alone for its error (header, payload) and copied aside: not
    # two reads a record (114).
    assert len(reads) <= 10, reads
    assert log.drain_damaged().tolist() == [37]
    assert log.damaged_messages == 1
    assert sorted(read_all(log)) == [o for o in range(2, 59) if o != 37]
    assert log.scrub_step(10**9) == 56 * record  # the next pass skips what was found
    log.close()


def test_the_scrub_skips_acknowledged_records_without_visiting_each(tmp_path, monkeypatch):
    """A queue whose consumers keep up has a long acknowledged head: a step skips it in
    one scan, not a record at a time (each step runs on the event loop, 20 a second)."""
    from raymq.storage import scrub

    log, _ = open_log(tmp_path, page=1 << 20)
    for _ in range(6):  # 3,000 records of one message each, in six group commits
        prepared = log.prepare([batch([b"m"]) for _ in range(500)], NOW_US)
        log.write(prepared)
        log.publish(prepared)
    log.ack(np.arange(0, 2998))
    commit(log)
    visited = []
    all_acked = scrub._all_acked
    monkeypatch.setattr(scrub, "_all_acked", lambda seg, k: visited.append(k) or all_acked(seg, k))
    seg = log.segments[0]
    record = seg.record_end(2998) - seg.positions[2998]
    assert log.scrub_step(10**6) == 2 * record  # the two unacknowledged records
    assert len(visited) < 10, len(visited)
    log.close()


def test_the_scrub_keeps_its_rate_over_records_larger_than_a_step(tmp_path):
    """A step reads a whole record however large: the queue's later steps pay for it,
    so the scrub reads at ``scrub_bytes_per_second`` on average, not a record a step."""
    rate = 100_000
    broker = BrokerConfig(paging_directory=str(tmp_path), scrub_bytes_per_second=rate)
    q = QueueCore(QueueConfig("q", page_size_bytes=2**20), broker)

    async def scenario():
        for _ in range(4):  # records of ~200 KB: 40 times a 50 ms step's 5 KB
            await q.send_batch(MessageBatch.from_encoded([b"s" * 1000] * 200, [b""] * 200))
        before, steps = q.log.scrubbed_bytes, 200  # ten seconds' worth of 50 ms steps
        for _ in range(steps):
            q._scrub(0.05)
        return q.log.scrubbed_bytes - before

    read = asyncio.run(_started(q, scenario))
    record = 200 * 1000
    assert record <= read <= rate * 10 + record  # ten seconds at the rate, one record over


def test_the_scrub_loop_rests_between_passes(tmp_path, monkeypatch):
    """A queue of a few records is read once a pass, not again at every step: after a
    pass the loop waits until ``SCRUB_PASS_SECONDS`` from its start."""
    from raymq.core import scrub_pacer

    monkeypatch.setattr(scrub_pacer, "SCRUB_STEP_SECONDS", 0.001)
    monkeypatch.setattr(scrub_pacer, "SCRUB_PASS_SECONDS", 3600.0)
    q = QueueCore(QueueConfig("q"), BrokerConfig(paging_directory=str(tmp_path)))

    async def scenario():
        await q.send_batch(MessageBatch.from_encoded([b"s" * 1000] * 3, [b""] * 3))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while q.log.scrub_passes == 0 and loop.time() < deadline:
            await asyncio.sleep(0.001)  # polls for the first pass; no timing assumed
        assert q.log.scrub_passes == 1
        read = q.log.scrubbed_bytes
        await asyncio.sleep(0.2)  # 200 steps' time: every one of them a pass before
        return read, q.log.scrubbed_bytes, q.log.scrub_passes

    first, later, passes = asyncio.run(_started(q, scenario))
    assert first > 0 and later == first and passes == 1


async def _started(q: QueueCore, scenario):
    q.start()
    try:
        return await scenario()
    finally:
        await q.close()


# -- a full disk, I/O errors ----------------------------------------------------------------


def _two_pages(tmp_path):
    """A log whose next send of 3,000 bytes needs a new segment file."""
    log, _ = open_log(tmp_path, page=4096)
    commit(log, [b"a" * 1500] * 2)
    return log


@pytest.mark.parametrize(
    ("call", "code"),
    [
        ("open", errno.ENOSPC),
        ("open", errno.EMFILE),
        ("pwritev", errno.ENOSPC),  # the new segment's header goes with its first records
        ("fdatasync", errno.EIO),
    ],
)
def test_a_new_segment_that_fails_is_a_storage_error_and_leaves_nothing(
    tmp_path, faults, call, code
):
    log = _two_pages(tmp_path)
    fds = open_fds()
    faults.fail(call, code, match=segment_name(2))
    with pytest.raises(StorageError) as err:
        commit(log, [b"b" * 1500] * 2)
    assert err.value.errno == code and err.value.filename.endswith(segment_name(2))
    assert "queue 'q'" in str(err.value) and os.strerror(code) in str(err.value)
    assert segment_files(tmp_path) == [segment_name(0)]  # no half-created file
    assert open_fds() == fds
    faults.heal()
    assert commit(log, [b"c" * 1500] * 2) == [2, 3]  # no restart needed
    log.close()
    log, _ = open_log(tmp_path, page=4096)
    assert read_all(log) == {0: b"a" * 1500, 1: b"a" * 1500, 2: b"c" * 1500, 3: b"c" * 1500}


@pytest.mark.parametrize(
    ("call", "after"), [("pwritev", False), ("pwritev", True), ("fdatasync", False)]
)
def test_a_write_that_raised_is_never_served_and_sends_resume(tmp_path, faults, call, after):
    log, _ = open_log(tmp_path)
    commit(log, [b"kept"] * 3)
    seg = log.segments[0]
    good = os.path.getsize(seg.path)
    faults.fail(call, errno.EIO, match=".seg", times=1, after=after)
    with pytest.raises(StorageError) as err:
        commit(log, [b"FAILED"] * 5)
    assert err.value.errno == errno.EIO and err.value.filename == seg.path
    assert os.path.getsize(seg.path) == good  # cut back to the last good length
    assert log.next_offset == 3 and log.writable
    assert commit(log, [b"after"]) == [3]
    assert b"FAILED" not in b"".join(read_all(log).values())
    log.close()
    log, report = open_log(tmp_path)
    assert report.damage == []
    assert read_all(log) == {0: b"kept", 1: b"kept", 2: b"kept", 3: b"after"}


def test_a_failed_directory_fsync_removes_the_new_segment(tmp_path, faults):
    log = _two_pages(tmp_path)
    faults.fail("fsync", errno.EIO, match=os.path.isdir, times=1)
    with pytest.raises(StorageError) as err:
        commit(log, [b"b" * 1500] * 2)
    assert err.value.filename == str(tmp_path)
    assert segment_files(tmp_path) == [segment_name(0)]
    assert commit(log, [b"c" * 1500] * 2) == [2, 3]


def test_while_the_cut_back_fails_sends_are_refused_and_acks_still_work(tmp_path, faults):
    log, _ = open_log(tmp_path)
    commit(log, [b"m"] * 4)
    faults.fail("fdatasync", errno.EIO, match=".seg")  # the write and its repair fail
    with pytest.raises(StorageError):
        commit(log, [b"x"])
    assert not log.writable
    with pytest.raises(StorageError) as err:
        commit(log, [b"y"])
    assert err.value.errno == errno.EIO
    log.ack(np.array([0, 1]))
    prepared = log.prepare([batch([b"z"])], NOW_US)  # a send and acks in one commit
    with pytest.raises(StorageError):
        log.write(prepared)
    log.abort(prepared)
    assert prepared.records_error is not None and prepared.ack_error is None
    assert prepared.acks_written  # the acks are durable though the send failed
    faults.heal()
    # The repair works now, and the send too; offset 4 was burned (recorded as
    # acknowledged) when the first cut-back failed: it is never given again.
    assert commit(log, [b"w"]) == [5]
    assert log.writable
    log.close()
    log, _ = open_log(tmp_path)
    assert read_all(log) == {2: b"m", 3: b"m", 5: b"w"}


def test_a_send_that_raised_is_not_served_after_a_crash_before_its_cut_back(tmp_path, faults):
    """Found by the simulator: the records reached the disk (the fdatasync failed after
    syncing), the cut-back failed too, then a crash: the send raised, yet after recovery
    its messages were served. The failed offsets are now acknowledged in the ack log."""
    log, _ = open_log(tmp_path)
    commit(log, [b"m"] * 4)
    faults.fail("fdatasync", errno.EIO, match=".seg", after=True)
    faults.fail("ftruncate", errno.EIO, match=".seg")
    with pytest.raises(StorageError):
        commit(log, [b"x"] * 3)
    crashed = copy_queue(str(tmp_path), str(tmp_path.parent / "crashed"))  # as it is now
    faults.heal()
    log, _ = open_log(crashed)
    assert read_all(log) == {0: b"m", 1: b"m", 2: b"m", 3: b"m"}
    assert commit(log, [b"next"]) == [7]


@pytest.mark.parametrize("after", [False, True])
def test_acks_that_fail_stay_applied_and_reach_the_log_later(tmp_path, faults, after):
    log, _ = open_log(tmp_path)
    commit(log, [b"m"] * 4)
    log.ack(np.array([0, 1]))
    faults.fail("writev", errno.EIO, match="acks-", times=1, after=after)
    with pytest.raises(StorageError) as err:
        commit(log)
    assert "acks-" in err.value.filename and err.value.errno == errno.EIO
    assert log.is_acked(np.array([0, 1])).all() and log.depth == 2
    assert log.has_pending_acks
    commit(log)
    assert not log.has_pending_acks
    log.close()
    log, report = open_log(tmp_path)
    assert report.damage == []  # the failed record was cut off the ack log
    assert sorted(read_all(log)) == [2, 3]


def test_a_failed_checkpoint_changes_nothing_and_is_tried_again(tmp_path, faults):
    log, _ = open_log(tmp_path)
    commit(log, [b"m"] * 4)
    faults.fail("fsync", errno.ENOSPC, match="checkpoint.tmp", times=1)
    assert commit(log, [b"n"], checkpoint=True) == [4]  # the send succeeded
    assert log.checkpoint_failures == 1
    assert log.last_storage_error.errno == errno.ENOSPC
    assert "checkpoint" in log.last_storage_error.filename
    assert not os.path.exists(tmp_path / "checkpoint.tmp")
    acks = sorted(f for f in os.listdir(tmp_path) if f.startswith("acks-"))
    assert len(acks) == 1  # still the generation it had
    log.ack(np.array([0]))
    commit(log, checkpoint=True)
    assert log.checkpoint_failures == 1
    log.close()
    log, report = open_log(tmp_path)
    assert report.used_checkpoint and sorted(read_all(log)) == [1, 2, 3, 4]


def test_an_unlink_that_fails_does_not_stop_the_log(tmp_path, faults):
    log, _ = open_log(tmp_path, page=4096)
    for _ in range(3):
        commit(log, [b"u" * 1500] * 2)
    faults.fail("unlink", errno.EROFS, match=".seg")
    log.ack(np.arange(0, 2))
    commit(log)  # the segment's file stays; the log goes on
    assert log.storage_errors >= 1 and log.last_storage_error.errno == errno.EROFS
    assert commit(log, [b"v"]) == [6]
    faults.fail("unlink", errno.EROFS, match="acks-")
    commit(log, checkpoint=True)  # the old ack log stays; the checkpoint is taken
    assert log.checkpoint_failures == 0
    faults.heal()
    log.close()
    log, _ = open_log(tmp_path, page=4096)  # recovery deletes the acknowledged file
    assert segment_name(0) not in segment_files(tmp_path)
    assert sorted(read_all(log)) == [2, 3, 4, 5, 6]


def _fill(log, tag: bytes, size: int = 8000) -> tuple[dict[int, bytes], StorageError]:
    """Send unique bodies until the disk is full; returns what was stored and the error."""
    stored: dict[int, bytes] = {}
    for i in range(10_000):
        bodies = [tag + f"-{i}-{j}-".encode() + b"x" * size for j in range(4)]
        try:
            offsets = commit(log, bodies)
        except StorageError as exc:
            return stored, exc
        stored.update(zip(offsets, bodies, strict=True))
    raise AssertionError("the disk never filled")


def test_a_full_disk_on_a_real_tmpfs(tmp_path):
    with small_tmpfs(str(tmp_path / "disk")) as disk:
        if disk is None:
            pytest.skip("mounting a tmpfs is not permitted here")
        directory = os.path.join(disk, "q")
        log, _ = open_log(directory)
        stored, err = _fill(log, b"first")
        assert err.errno == errno.ENOSPC and err.filename.startswith(directory)
        assert "queue 'q'" in str(err)
        # Acks keep working while the disk is full, even in a commit with a send.
        log.ack(np.arange(0, 16))
        prepared = log.prepare([batch([b"no room" * 5000])], NOW_US)
        with pytest.raises(StorageError):
            log.write(prepared)
        log.abort(prepared)
        assert prepared.acks_written and prepared.ack_error is None
        # Consuming frees whole segments; sends then resume without a restart.
        offsets = sorted(stored)
        log.ack(np.array(offsets[: len(offsets) // 2]))
        commit(log)
        more, _ = _fill(log, b"second")
        assert more
        log.close()
        log, report = open_log(directory)
        expected = {o: b for o, b in {**stored, **more}.items() if o >= offsets[len(offsets) // 2]}
        assert read_all(log) == expected
        assert report.lost_messages == 0
        log.close()


def test_recovery_opens_on_a_full_disk_with_no_ack_log_it_can_append_to(tmp_path):
    """The disk filled while the queue was down and its ack log's header is damaged
    (so it cannot be appended to): recovery starts the new ack log in the room the old
    one had reserved, acks reach the disk while it is full, sends resume once space
    returns. (Recovery failed with ENOSPC before.)"""
    with small_tmpfs(str(tmp_path / "disk")) as disk:
        if disk is None:
            pytest.skip("mounting a tmpfs is not permitted here")
        directory = os.path.join(disk, "q")
        log, _ = open_log(directory)
        sent = commit(log, [f"m{i}".encode() * 100 for i in range(20)])
        log.ack(np.arange(5))
        commit(log)
        log.close()
        [ack_file] = [f for f in os.listdir(directory) if f.startswith(ACK_PREFIX)]
        flip(os.path.join(directory, ack_file), 20)  # inside the header's CRC
        filler = os.path.join(disk, "filler")
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        with pytest.raises(OSError) as full:
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        assert full.value.errno == errno.ENOSPC

        log, report = open_log(directory)
        assert sorted(read_all(log)) == sent[5:]
        assert any("started on a full disk" in d for d in report.damage), report.damage
        log.ack(np.arange(5, 10))
        commit(log)  # acks reach the disk while it is full
        with pytest.raises(StorageError):
            commit(log, [b"no room" * 5000])
        os.remove(filler)
        [again] = commit(log, [b"again"])
        assert again == 20
        log.close()
        log, report = open_log(directory)
        assert sorted(read_all(log)) == [*sent[10:], 20]
        assert report.lost_messages == 0
        log.close()


def test_a_full_disk_through_the_queue_core(tmp_path):
    """QueueCore as it is: producers get StorageError, consumers keep receiving and
    acking, and sends resume by themselves once acks freed room."""
    with small_tmpfs(str(tmp_path / "disk")) as disk:
        if disk is None:
            pytest.skip("mounting a tmpfs is not permitted here")
        broker = BrokerConfig(paging_directory=disk, head_cache_bytes=2**20)
        q = QueueCore(QueueConfig("q", page_size_bytes=64 * 1024), broker)

        async def scenario():
            sent = 0
            with pytest.raises(StorageError) as err:
                for i in range(10_000):
                    body = [f"{i}-{j}".encode() + b"y" * 8000 for j in range(4)]
                    await q.send_batch(MessageBatch.from_bodies(body, None, max_message_size=2**20))
                    sent += 4
            assert err.value.errno == errno.ENOSPC
            q.register_consumer("c", 10_000)
            received = 0
            while received < sent:
                got = await q.fetch("c", 1000, 0.2, 10_000)
                assert got.num_rows
                received += got.num_rows
                await q.ack("c", got.column("offset").to_numpy())
            first, count = await q.send_batch(
                MessageBatch.from_bodies([b"again"], None, max_message_size=2**20)
            )
            assert (first, count) == (sent, 1)

        async def main():
            q.start()
            try:
                await scenario()
            finally:
                await q.close()

        asyncio.run(main())


# -- offsets are never given twice ---------------------------------------------------------


def _drained_queue(path) -> None:
    """50 messages sent over several segments, all acknowledged, then a checkpoint: the
    older segments are deleted, the newest stays (its name keeps the highest offset)."""
    log, _ = open_log(path, page=4096)
    for _ in range(5):
        commit(log, [b"m" * 400] * 10)
    log.ack(np.arange(50))
    commit(log)
    commit(log, checkpoint=True)
    assert len(segment_files(path)) == 1
    log.close()


def test_offsets_never_go_back_whatever_byte_of_the_checkpoint_or_ack_log_is_damaged(tmp_path):
    src = tmp_path / "src"
    _drained_queue(src)
    trials = 0
    for name in sorted(os.listdir(src)):
        for position in range(os.path.getsize(src / name)):
            work = copy_queue(str(src), str(tmp_path / f"t{trials}"))
            flip(os.path.join(work, name), position)
            log, report = open_log(work)
            if name.endswith(".seg"):  # its count unknown: what it could hold is skipped
                assert log.next_offset >= 50, (name, position, report.damage)
            else:
                assert log.next_offset == 50, (name, position, report.damage)
            assert commit(log, [b"next"]) == [log.next_offset - 1]
            log.close()
            trials += 1
    assert trials > 60


def test_offsets_never_go_back_when_checkpoint_and_ack_log_are_both_damaged(tmp_path):
    """Found by the simulator (seed 1545): the ack log's records and the checkpoint
    damaged, every segment acknowledged: the kept newest segment still knows."""
    _drained_queue(tmp_path)
    for name in os.listdir(tmp_path):
        if name.startswith("acks-") or name == "checkpoint":
            size = os.path.getsize(tmp_path / name)
            for position in range(0, size, 7):
                flip(str(tmp_path / name), position)
    log, report = open_log(tmp_path)
    assert log.next_offset == 50, report.damage
    assert commit(log, [b"next"]) == [50]


def test_offsets_never_go_back_when_the_checkpoint_is_lost_after_more_sends(tmp_path):
    _drained_queue(tmp_path)
    log, _ = open_log(tmp_path)
    commit(log, [b"n"] * 10)  # 50..59, acknowledged: only the ack log knows them now
    log.ack(np.arange(50, 60))
    commit(log)
    log.close()
    flip(str(tmp_path / "checkpoint"), 30)
    log, report = open_log(tmp_path)
    assert any("checkpoint" in line for line in report.damage)
    assert commit(log, [b"next"]) == [60]


# -- private files ---------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        paging = tmp_path / "paging"
        durable = paging / "durable"
        log, _ = open_log(durable)
        for i in range(3):
            commit(log, [f"d{i}".encode()] * 3)
        log.ack(np.array([0]))
        commit(log, checkpoint=True)
        seg = log.segments[0]
        flip(seg.path, seg.positions[1] + RECORD_HEADER.size + 2)
        log.set_read_cache_bytes(0)
        read_all(log)  # quarantines, keeping the damaged bytes aside
        transient, _ = open_log(paging / "transient", durable=False)
        transient.memory_limit = 0
        commit(transient, [b"t"] * 10)  # flows to disk
        assert transient.segment_files == 1
        seen = []
        for root, dirs, files in os.walk(paging):
            for d in dirs:
                assert os.stat(os.path.join(root, d)).st_mode & 0o777 == 0o700, d
            for f in files:
                assert os.stat(os.path.join(root, f)).st_mode & 0o777 == 0o600, f
                seen.append(f)
        assert os.stat(paging).st_mode & 0o777 == 0o700
        assert {"checkpoint", segment_name(0)} <= set(seen)
        assert any(".damaged-" in f for f in seen) and any(f.startswith("acks-") for f in seen)
        log.close()
        transient.close()
    finally:
        os.umask(old)


def test_a_new_queue_directory_is_made_durable_in_the_paging_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(fd_path(fd))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    paging = tmp_path / "paging"
    paging.mkdir()
    create_queue_directory(str(paging / "orders"))
    assert synced == [str(paging)]
    assert os.stat(paging / "orders").st_mode & 0o777 == 0o700
    create_queue_directory(str(paging / "orders"))  # idempotent


# -- rot in the newest record, found by recovery -------------------------------------------


def _rotten_last_record(path) -> str:
    """Records 0-3 and 4-7 in one segment, not checkpointed, one bit of the last
    record's payload flipped; returns the segment's path."""
    log, _ = open_log(path)
    commit(log, [b"a" * 100] * 4)
    commit(log, [b"b" * 100] * 4)
    seg = log.segments[0]
    flip(seg.path, seg.positions[1] + 60)
    log.close()
    return seg.path


def test_a_flipped_bit_in_the_newest_record_is_damage_not_a_torn_tail(tmp_path):
    """Found by the simulator: a complete last record with a bad CRC cannot be a crash
    (the writer syncs whole records): it is damage, counted, its offsets not reused."""
    _rotten_last_record(tmp_path)
    log, report = open_log(tmp_path)
    assert report.damaged == 4 and report.truncated_bytes == 0, report.damage
    assert sorted(read_all(log)) == [0, 1, 2, 3]
    assert commit(log, [b"next"]) == [8]


def test_a_torn_last_record_is_still_a_torn_tail(tmp_path):
    log, _ = open_log(tmp_path)
    commit(log, [b"a" * 100] * 4)
    commit(log, [b"b" * 100] * 4)
    seg = log.segments[0]
    end, pos = seg.size, seg.positions[1]
    log.close()
    truncate(seg.path, end - 10)
    log, report = open_log(tmp_path)
    assert report.damaged == 0 and report.truncated_bytes == end - 10 - pos
    assert sorted(read_all(log)) == [0, 1, 2, 3]


def test_damage_found_by_a_recovery_that_cannot_checkpoint_is_found_again(tmp_path, faults):
    """Found by the simulator: recovery cut a damaged tail, then failed on a full disk;
    the next recovery saw a clean, shorter file and the loss went uncounted."""
    path = _rotten_last_record(tmp_path)
    size = os.path.getsize(path)
    faults.fail("open", errno.ENOSPC, match="checkpoint")
    log, report = open_log(tmp_path)
    assert report.damaged == 4
    log.close()
    assert os.path.getsize(path) == size  # not cut: no checkpoint says so yet
    faults.heal()
    log, report = open_log(tmp_path)
    assert report.damaged == 4  # found, and counted, again
    log.close()


def test_a_deleted_segment_back_after_a_crash_is_not_delivered_again(tmp_path):
    """Found by the simulator: a segment's unlink never reached the disk while the
    later checkpoint's rename did; its acks were in ack logs that checkpoint retired."""
    log, _ = open_log(tmp_path, page=4096)
    for _ in range(3):
        commit(log, [b"m" * 400] * 10)
    first = log.segments[0]
    with open(first.path, "rb") as f:
        saved = f.read()
    log.ack(np.arange(first.base_offset, first.end_offset))
    commit(log)
    commit(log, checkpoint=True)
    commit(log, checkpoint=True)  # the ack log holding those acks is retired
    assert not os.path.exists(first.path)
    log.close()
    with open(first.path, "wb") as f:  # the unlink "never reached the disk"
        f.write(saved)
    log, report = open_log(tmp_path)
    assert min(read_all(log)) == 10 and not os.path.exists(first.path), report.damage


def test_a_burned_write_that_comes_back_after_a_checkpoint_is_not_served(tmp_path, faults):
    """Found by the simulator: the cut-back of a failed write never reached the disk, a
    checkpoint then retired the ack log that burned its offsets, and a crash brought the
    records back. Records past a segment's checkpointed size with offsets below the
    checkpoint's next offset were never published: recovery cuts them off."""
    log, _ = open_log(tmp_path)
    commit(log, [b"m"] * 4)
    seg_path = log.segments[0].path
    faults.fail("fdatasync", errno.EIO, match=".seg", after=True)
    faults.fail("ftruncate", errno.EIO, match=".seg")
    with pytest.raises(StorageError):
        commit(log, [b"x"] * 3)
    with open(seg_path, "rb") as f:
        with_failed_records = f.read()
    faults.heal()
    commit(log, checkpoint=True)  # the cut-back works now; the checkpoint follows
    commit(log, checkpoint=True)  # and the ack log with the burn is retired
    log.close()
    with open(seg_path, "wb") as f:  # the truncation "never reached the disk"
        f.write(with_failed_records)
    log, report = open_log(tmp_path)
    assert read_all(log) == {0: b"m", 1: b"m", 2: b"m", 3: b"m"}, report.damage
    assert commit(log, [b"next"]) == [7]


def test_offsets_no_record_holds_are_never_delivered(tmp_path):
    """Found by the simulator: a damaged first record (its header unreadable) was cut
    off, new records were appended after the offsets it could have held, then the
    checkpoint was damaged: the gap before the new records was delivered, unreadable,
    and stayed in flight for ever."""
    log, _ = open_log(tmp_path)
    commit(log, [b"a" * 200] * 4)
    path = log.segments[0].path
    log.close()
    flip(path, 40 + 9)  # inside the first record's header
    log, report = open_log(tmp_path)
    assert report.damaged >= 4  # the count unknown: as many as the bytes could hold
    new = commit(log, [b"new"])
    log.close()
    flip(str(tmp_path / "checkpoint"), 30)
    log, report = open_log(tmp_path)
    assert read_all(log) == {new[0]: b"new"}
    assert log.unacked(0, 10**6).tolist() == new


def test_a_burn_that_fails_still_never_gives_its_offsets_again(tmp_path, faults):
    """Found by the simulator: the burn's ack-log append raised after reaching the disk,
    the offsets were given again to the next send, and recovery then found that send's
    messages acknowledged: stored messages lost."""
    log, _ = open_log(tmp_path)
    commit(log, [b"m"] * 4)
    faults.fail("fdatasync", errno.EIO, match=".seg", after=True)
    faults.fail("ftruncate", errno.EIO, match=".seg")
    faults.fail("fdatasync", errno.EIO, match="acks-", after=True)  # the burn "fails"
    with pytest.raises(StorageError):
        commit(log, [b"x"] * 3)
    faults.heal()
    assert commit(log, [b"kept"]) == [7]  # never 4: offsets 4..6 may be acked on disk
    log.close()
    log, _ = open_log(tmp_path)
    assert read_all(log)[7] == b"kept"


@pytest.mark.parametrize("where", ["record", "header"])
def test_damage_found_by_a_recovery_that_fails_is_found_again(tmp_path, faults, where):
    """Found by the simulator (seed 50432): recovery deleted a segment whose every
    offset was lost (or moved one with a bad header aside), then failed to start an ack
    log on a full disk; the next recovery found nothing and the loss went uncounted."""
    log, _ = open_log(tmp_path, page=4096)
    for _ in range(3):
        commit(log, [b"m" * 400] * 8)
    first = log.segments[0]
    assert first.end_offset == 8 and len(log.segments) == 3
    flip(first.path, 0 if where == "header" else int(first.positions[0]) + 60)
    log.close()
    faults.fail("open", errno.ENOSPC, match="acks-")  # no ack log to create or reopen
    with pytest.raises(StorageError):
        open_log(tmp_path, page=4096)
    faults.heal()
    log, report = open_log(tmp_path, page=4096)
    assert report.damaged == 8, report.damage
    assert sorted(read_all(log)) == list(range(8, 24))
    assert commit(log, [b"next"]) == [24]
    log.close()


# -- an address: its open may fail after recovery ------------------------------------------


def _address_with_damage(path, where: str) -> tuple[list[str], str]:
    """An address (a ``subscriptions`` file, one subscription) with 3 segments of 8
    messages, the newest not checkpointed, then one bit flipped: in the first segment's
    header, in a record of the newest one, or in its last record (its damaged end).
    Returns the segment files and the flipped one."""
    log, _ = open_log(path, page=4096)
    acks = SubscriptionAcks(log)
    log.attach_subscriptions(acks)
    acks.create(0, 0)
    write_manifest(str(path), Manifest({"s": SubscriptionSpec("s", 0, None, 0)}, 1))
    for _ in range(2):
        commit(log, [b"m" * 400] * 8)
    commit(log, checkpoint=True)
    for _ in range(2):
        commit(log, [b"n" * 400] * 4)  # the newest segment: two records, scanned again
    assert [s.count for s in log.segments] == [8, 8, 8]
    files = [s.path for s in log.segments]
    newest = log.segments[-1]
    if where == "header":
        damaged, position = files[0], 20
    elif where == "record":
        damaged, position = newest.path, int(newest.positions[0]) + 60
    else:
        damaged, position = newest.path, int(newest.positions[1]) + 60
    log.close()
    flip(damaged, position)
    return files, damaged


def _address_opened(path) -> tuple[SegmentLog, SubscriptionAcks]:
    """The address's log, opened with its subscription settled as ``QueueCore`` does."""
    log, report = open_log(path, page=4096)
    acks = SubscriptionAcks(log)
    log.attach_subscriptions(acks)
    acks.load(0, log.recovered_subscriptions.get(0), 0)
    acks.settle()
    return log, report


def _snapshot(path) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.parametrize("where", ["header", "record", "end"])
def test_damage_found_before_an_address_fails_to_open_is_found_again(tmp_path, where):
    """An address can fail to open after recovery (its subscriptions file unreadable,
    the disk full while their acks are committed): recovery's checkpoint, the renaming
    of a file with a bad header and the cutting of a damaged end then hid the damage it
    found from the next recovery, which counted none of it. They wait for the first
    checkpoint of the running log, which comes with its first commit."""
    files, damaged = _address_with_damage(tmp_path, where)
    lost = 8 if where == "header" else 4
    log, report = open_log(tmp_path, page=4096)
    assert report.damaged == lost, report.damage
    log.close()  # the address's open failed before any commit
    before = _snapshot(tmp_path)
    log, report = open_log(tmp_path, page=4096)  # and again: nothing hidden, not even
    log.close()  # by a recovery that did not find it first
    assert report.damaged == lost, report.damage
    after = _snapshot(tmp_path)
    assert {n: b for n, b in after.items() if not n.startswith("acks-")} == {
        n: b for n, b in before.items() if not n.startswith("acks-")
    }
    log, report = _address_opened(tmp_path)
    assert report.damaged == lost
    assert log.has_pending_acks  # the checkpoint recovery left to the first commit
    commit(log)  # the open's commit: acks, then that checkpoint
    assert not log.has_pending_acks
    assert os.path.exists(damaged + ".damaged") == (where == "header")
    kept = sorted(read_all(log))
    log.close()
    if where == "end":  # cut, once that checkpoint was durable
        assert os.path.getsize(damaged) < len(before[os.path.basename(damaged)])
    log, report = _address_opened(tmp_path)
    assert report.damaged == 0, report.damage  # found, counted and recorded once
    assert report.lost_messages == (0 if where == "header" else lost)
    assert sorted(read_all(log)) == kept
    assert commit(log, [b"next"])[0] >= 24  # (past what a file moved aside could hold)
    log.close()


@pytest.mark.parametrize("fails", ["manifest", "commit"])
def test_an_address_that_fails_to_open_counts_its_damage_at_the_next_open(
    tmp_path, faults, monkeypatch, fails
):
    """Through QueueCore: an address whose open fails after recovery found damage (its
    ``subscriptions`` file damaged, or the disk failing while the acks settled at open
    are committed) leaves that damage for the next open to find and count."""
    broker = BrokerConfig(paging_directory=str(tmp_path), checkpoint_interval=3600.0)
    config = QueueConfig("addr", page_size_bytes=4096, address=True)
    directory = tmp_path / "addr"

    async def fill():
        core = QueueCore(config, broker)
        core.start()
        await core.create_subscription("s")
        for _ in range(3):
            await core.send_batch(batch([b"m" * 400] * 8))
        await core.close()

    asyncio.run(fill())
    flip(str(directory / segment_files(directory)[0]), 20)  # a header: 8 messages lost
    manifest = directory / MANIFEST_NAME
    good = manifest.read_bytes()
    commit_acks = QueueCore._commit_acks_now
    if fails == "manifest":
        flip(str(manifest), 30)
    else:  # one created just before a crash: its starting set is committed at open
        m = read_manifest(str(directory), "addr")
        late = SubscriptionSpec("late", m.next_id, None, 0)
        write_manifest(str(directory), Manifest({**m.subscriptions, "late": late}, m.next_id + 1))

        def failing(self):
            faults.fail("fdatasync", errno.EIO, match="acks-")
            commit_acks(self)

        monkeypatch.setattr(QueueCore, "_commit_acks_now", failing)
    with pytest.raises(StorageError):
        QueueCore(config, broker)
    faults.heal()
    monkeypatch.setattr(QueueCore, "_commit_acks_now", commit_acks)
    manifest.write_bytes(good if fails == "manifest" else manifest.read_bytes())

    async def reopen():
        core = QueueCore(config, broker)
        core.start()
        await core.close()
        return core.recovery

    report = asyncio.run(reopen())
    assert report.damaged == 8, report.damage
    assert asyncio.run(reopen()).damaged == 0  # counted once its open succeeded


@pytest.mark.parametrize("how", ["fetch", "lease"])
def test_a_take_that_finds_its_record_damaged_delivers_none_of_it_even_from_the_cache(
    tmp_path, how
):
    """A selector's matches 10 and 150 of one 200-message record, the HeadQueueCache
    holding only its first part: 10 was materialized from the cache's intact copy, then
    the read of 150 from disk found the record damaged and quarantined it. 10 was
    delivered all the same (by a fetch, or a lease's read), though counted damaged (and
    acknowledged) with the rest."""

    async def scenario():
        broker = BrokerConfig(paging_directory=str(tmp_path), head_cache_bytes=100 * 1024)
        q = QueueCore(QueueConfig("q"), broker)
        q.start()
        try:
            n, body = 200, b"x" * 1024
            props = [{"k": 1} if i in (10, 150) else None for i in range(n)]
            await q.send_batch(MessageBatch.from_bodies([body] * n, props, max_message_size=2**20))
            q.housekeeping()  # the refill: what fits of the record
            cached = q.head_cache.covers(10, 11) and not q.head_cache.covers(150, 151)
            seg = q.log.segments[0]
            pos = int(seg.positions[0]) + RECORD_HEADER.size + 8 * n + 2 * 8 * (n + 1)
            flip(seg.path, pos + 150 * len(body) + 5)  # a byte of 150's body
            if how == "fetch":
                q.register_consumer("c", 10, "k = 1")
                rows = await q.fetch("c", 10, 0.0, 10)
            else:
                leased, _ = await q.lease("c", 10, "k = 1")
                assert leased.tolist() == [10, 150]  # (the properties read does not check)
                rows = q.read_leased("c", leased)
            return cached, rows.column("offset").to_pylist(), q.stats()
        finally:
            await q.close()

    cached, delivered, stats = asyncio.run(scenario())
    assert cached  # the scenario
    assert delivered == []
    assert stats.damaged_messages == 200 and stats.in_flight == 0
