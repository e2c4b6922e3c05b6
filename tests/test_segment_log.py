"""The segment log without Ray: round trip, rollover, acks, deletion, recovery."""

from __future__ import annotations

import os

import numpy as np
import pytest

from raymq.storage import SegmentLog
from raymq.storage.format import RECORD_HEADER, SEGMENT_HEADER, SEGMENT_SUFFIX
from tests.storage_helpers import commit, read_all

PAGE = 64 * 1024


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def open_log(path, durable=True, page=PAGE):
    return SegmentLog.open(str(path), queue="q", page_size_bytes=page, durable=durable)


def segment_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(SEGMENT_SUFFIX))


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "memory"])
def test_round_trip_with_properties(tmp_path, durable):
    log, _ = open_log(tmp_path, durable)
    bodies = [f"m{i}".encode() * (i + 1) for i in range(50)]
    props = [{"i": i, "color": "red" if i % 2 else "blue", "x": None} for i in range(50)]
    offsets = commit(log, bodies, props)
    assert offsets == list(range(50))
    batches = log.read(0, 50)
    rb = [b.to_arrow() for b in batches]
    got = [r for b in rb for r in b.column("body").to_pylist()]
    assert got == bodies
    assert log.depth == 50
    from raymq.properties import decode_properties

    assert decode_properties(batches[0].properties_bytes(3)) == props[3]


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "memory"])
def test_rollover_at_page_size(tmp_path, durable):
    log, _ = open_log(tmp_path, durable, page=8192)
    for _ in range(10):
        commit(log, [b"x" * 1000] * 3)
    # 3,000 bytes of bodies a record: two records fit a page of 8 KiB, not three.
    assert len(log.segments) == 5
    if durable:
        assert len(segment_files(tmp_path)) == 5
        for f in segment_files(tmp_path):
            assert os.path.getsize(tmp_path / f) <= 8192 + RECORD_HEADER.size + SEGMENT_HEADER.size
    assert len(read_all(log)) == 30


def test_batch_larger_than_a_page_is_split(tmp_path):
    log, _ = open_log(tmp_path, page=8192)
    commit(log, [b"y" * 1000] * 40)
    assert len(log.segments) >= 5
    assert list(read_all(log)) == list(range(40))


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "memory"])
def test_fully_acked_segment_in_the_middle_is_deleted(tmp_path, durable):
    log, _ = open_log(tmp_path, durable, page=4096)
    for _ in range(6):
        commit(log, [b"z" * 1500] * 2)  # one record of 3,000 bytes per segment
    assert len(log.segments) == 6
    middle = log.segments[2]
    log.ack(np.arange(middle.base_offset, middle.end_offset))
    commit(log)
    assert middle not in log.segments and len(log.segments) == 5
    if durable:
        assert len(segment_files(tmp_path)) == 5
    assert log.depth == 10
    assert sorted(read_all(log)) == [o for o in range(12) if not 4 <= o < 6]


def test_acks_survive_restart_and_deleted_segments_stay_gone(tmp_path):
    log, _ = open_log(tmp_path, page=4096)
    for _ in range(4):
        commit(log, [b"a" * 1500] * 2)
    log.ack(np.array([0, 1, 3, 6]))
    commit(log)
    log.close()
    log2, report = open_log(tmp_path, page=4096)
    assert sorted(read_all(log2)) == [2, 4, 5, 7]
    assert report.depth == 4
    assert log2.next_offset == 8
    assert len(segment_files(tmp_path)) == 3
    # New sends continue after the old offsets.
    assert commit(log2, [b"new"]) == [8]


def test_all_acked_then_restart_never_reuses_offsets(tmp_path):
    log, _ = open_log(tmp_path)
    commit(log, [b"a", b"b"])
    log.ack(np.array([0, 1]))
    commit(log)
    assert segment_files(tmp_path) == []
    log.close()
    log2, _ = open_log(tmp_path)
    assert commit(log2, [b"c"]) == [2]


def test_checkpoint_recovery_scans_only_the_tail(tmp_path):
    log, _ = open_log(tmp_path, page=1 << 20)
    commit(log, [b"p"] * 100)
    log.ack(np.arange(0, 10))
    commit(log, [b"q"] * 5, checkpoint=True)
    commit(log, [b"r"] * 5)
    log.ack(np.array([50]))
    commit(log)
    log.close()
    log2, report = open_log(tmp_path, page=1 << 20)
    assert report.used_checkpoint
    got = read_all(log2)
    assert sorted(got) == [o for o in range(10, 110) if o != 50]
    assert got[105] == b"r"


def _last_record_position(path):
    log, _ = open_log(path)
    seg = log.segments[-1]
    pos, size = seg.positions[-1], seg.size
    log.close()
    return seg.path, pos, size


def test_truncation_at_every_byte_of_the_last_record(tmp_path):
    src = tmp_path / "src"
    log, _ = open_log(src)
    commit(log, [b"first"] * 3)
    commit(log, [b"second-record"] * 2, [{"k": 1}, {"k": 2}])
    log.close()
    seg_path, pos, size = _last_record_position(src)
    with open(seg_path, "rb") as f:
        original = f.read()
    for cut in range(pos, size):
        work = tmp_path / f"cut{cut}"
        work.mkdir()
        for name in os.listdir(src):
            if name.endswith(SEGMENT_SUFFIX):  # only the segment: no checkpoint help
                (work / name).write_bytes(original[:cut])
        log2, report = open_log(work)
        assert read_all(log2) == {0: b"first", 1: b"first", 2: b"first"}, cut
        expected_cut = cut - pos
        assert report.truncated_bytes == expected_cut, cut
        assert os.path.getsize(work / os.path.basename(seg_path)) == pos
        assert commit(log2, [b"after"]) == [3]
        log2.close()


def test_flipped_byte_in_the_middle_is_reported_never_served(tmp_path):
    log, _ = open_log(tmp_path)
    for i in range(3):
        commit(log, [f"rec{i}-{j}".encode() for j in range(4)])
    seg = log.segments[0]
    middle_pos = seg.positions[1]
    log.close()
    os.unlink(tmp_path / "checkpoint")
    data = bytearray(_read(seg.path))
    data[middle_pos + RECORD_HEADER.size + 20] ^= 0xFF  # inside the payload
    _write(seg.path, bytes(data))
    log2, report = open_log(tmp_path)
    got = read_all(log2)
    assert sorted(got) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert report.lost_messages == 4
    assert any("damaged" in line for line in report.damage)
    assert got[8] == b"rec2-0"


def test_flipped_byte_in_a_header_is_reported(tmp_path):
    log, _ = open_log(tmp_path)
    for i in range(3):
        commit(log, [f"h{i}".encode()] * 2)
    seg = log.segments[0]
    pos = seg.positions[1]
    log.close()
    os.unlink(tmp_path / "checkpoint")
    data = bytearray(_read(seg.path))
    data[pos + 13] ^= 0x01  # the length field
    _write(seg.path, bytes(data))
    log2, report = open_log(tmp_path)
    assert sorted(read_all(log2)) == [0, 1, 4, 5]
    assert report.lost_messages == 2


def test_non_durable_queue_writes_no_segment_files(tmp_path):
    log, _ = open_log(tmp_path, durable=False)
    commit(log, [b"m"] * 10)
    assert segment_files(tmp_path) == []
    assert log.bytes_in_memory > 0
    log.ack(np.arange(10))
    commit(log)
    assert log.bytes_in_memory == 0
