"""The segment log without Ray: round trip, rollover, acks, deletion, recovery, the
format's framing (version 2 and version 1) and what recovery calls damage."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from raymq.storage import SegmentLog
from raymq.storage.format import (
    RECORD_HEADER,
    SEGMENT_HEADER,
    SEGMENT_HEADER_V1,
    SEGMENT_MAGIC,
    SEGMENT_SUFFIX,
)
from raymq.storage.record import encode_record
from tests.storage_helpers import (
    NOW_US,
    batch,
    commit,
    copy_queue,
    flip,
    read_all,
    truncate,
    write_v1_segment,
)

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
    assert len(segment_files(tmp_path)) == 1  # the newest stays
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


# -- format version 2: framing that cannot be forged from inside a payload ---------------


def _forged(first: int, bodies: list[bytes], salt, position: int) -> bytes:
    """A complete, valid-looking record claiming ``first``, framed for ``salt`` at
    ``position`` (None: version 1 framing, what a v1 reader trusts)."""
    b = batch(bodies)
    b.first_offset = first
    b.timestamps = np.full(len(b), NOW_US, dtype=np.int64)
    return b"".join(bytes(memoryview(x).cast("B")) for x in encode_record(b, salt, position))


def _queue_with_hidden_record(path, inner: str, *, last: bool):
    """Record A (offsets 0, 1), then record B (2, 3) whose first body holds a complete
    record claiming offsets 2 and 3 with bodies FORGED-*, then (unless ``last``) record
    C (4). Returns (segment path, B's position, B's end, A's first body)."""
    log, _ = open_log(path)
    commit(log, [b"a0", b"a1"])
    seg = log.segments[0]
    pos_b = seg.size
    # Where the hidden record lands: after B's header, timestamps and offset arrays.
    pad = b"p" * 7
    inner_pos = pos_b + RECORD_HEADER.size + 8 * 2 + 16 * 3 + len(pad)
    salt = {
        "v1": None,  # what the old reader resynchronised on
        "other-salt": (seg.salt or 0) ^ 0x5A5A,
        "same-salt-other-position": seg.salt,  # valid only at B's own position
    }[inner]
    where = pos_b if inner == "same-salt-other-position" else inner_pos
    hidden = _forged(2, [b"FORGED-A", b'{"admin": true}'], salt, where)
    commit(log, [pad + hidden + b"tail", b"b1"])
    end_b = seg.size
    if not last:
        commit(log, [b"c0"])
    log.close()
    os.unlink(path / "checkpoint")  # recovery scans everything
    return seg.path, pos_b, end_b


def _no_forgery(got: dict[int, bytes]) -> None:
    assert not [b for b in got.values() if b"FORGED" in b or b"admin" in b]


INNER = ["v1", "other-salt", "same-salt-other-position"]


@pytest.mark.parametrize("inner", INNER)
def test_hidden_record_never_served_when_the_outer_header_is_damaged(tmp_path, inner):
    seg_path, pos_b, _ = _queue_with_hidden_record(tmp_path, inner, last=False)
    flip(seg_path, pos_b + 13)  # B's length field: B cannot be framed any more
    log, report = open_log(tmp_path)
    got = read_all(log)
    _no_forgery(got)
    assert got == {0: b"a0", 1: b"a1", 4: b"c0"}
    assert report.lost_messages == 2 and report.truncated_bytes == 0
    assert commit(log, [b"next"]) == [5]  # offsets 2 and 3 are never given again


@pytest.mark.parametrize("inner", INNER)
def test_hidden_record_never_served_when_the_outer_payload_is_damaged(tmp_path, inner):
    seg_path, pos_b, _ = _queue_with_hidden_record(tmp_path, inner, last=False)
    flip(seg_path, pos_b + RECORD_HEADER.size + 3)  # a timestamp byte of B
    log, report = open_log(tmp_path)
    got = read_all(log)
    _no_forgery(got)
    assert got == {0: b"a0", 1: b"a1", 4: b"c0"}
    assert report.lost_messages == 2
    assert commit(log, [b"next"]) == [5]


@pytest.mark.parametrize("inner", INNER)
def test_hidden_record_never_served_when_the_outer_record_is_torn(tmp_path, inner):
    seg_path, pos_b, end_b = _queue_with_hidden_record(tmp_path, inner, last=True)
    for cut in (end_b - 1, end_b - 5, pos_b + 40):  # torn after the hidden record, or in it
        work = tmp_path / f"cut{cut}"
        work.mkdir()
        data = _read(seg_path)[:cut]
        _write(work / os.path.basename(seg_path), data)
        log, report = open_log(work)
        got = read_all(log)
        _no_forgery(got)
        assert got == {0: b"a0", 1: b"a1"}
        assert report.truncated_bytes == cut - pos_b  # B's send never returned: torn
        log.close()


def test_a_record_copied_into_a_payload_of_the_same_segment_is_not_valid(tmp_path):
    """Version 2 CRCs cover the record's own position: a genuine record's bytes copied
    elsewhere in its own segment frame nothing."""
    log, _ = open_log(tmp_path)
    commit(log, [b"genuine-0", b"genuine-1"])
    seg = log.segments[0]
    genuine = _read(seg.path)[seg.header_size : seg.size]
    commit(log, [b"q" * 5 + genuine, b"x"])
    commit(log, [b"after"])
    pos_b = seg.positions[1]
    log.close()
    os.unlink(tmp_path / "checkpoint")
    flip(seg.path, pos_b + 13)
    log, report = open_log(tmp_path)
    assert read_all(log) == {0: b"genuine-0", 1: b"genuine-1", 4: b"after"}
    assert report.lost_messages == 2
    assert list(log.segments[0].firsts) == [0, 4]  # the copy was not taken for a record


# -- version 1 files ---------------------------------------------------------------------


def test_version_1_segments_are_still_read_and_new_records_go_to_version_2(tmp_path):
    v1 = write_v1_segment(str(tmp_path), 0, [[b"old0", b"old1"], [b"old2"]])
    log, report = open_log(tmp_path)
    assert report.damage == [] and read_all(log) == {0: b"old0", 1: b"old1", 2: b"old2"}
    assert commit(log, [b"new"]) == [3]
    assert segment_files(tmp_path) == [os.path.basename(v1), "00000000000000000003.seg"]
    new = _read(tmp_path / "00000000000000000003.seg")
    assert new[:12] == SEGMENT_MAGIC + struct.pack("<I", 2)
    log.close()
    log, _ = open_log(tmp_path)
    assert read_all(log) == {0: b"old0", 1: b"old1", 2: b"old2", 3: b"new"}


def test_version_1_damage_is_never_resynchronised(tmp_path):
    """A v1 record has no salt: after damage, nothing later in the file can be told
    from bytes of a body, so none of it is served (it is reported and kept aside)."""
    hidden = _forged(1, [b"FORGED-A"], None, 0)
    path = write_v1_segment(str(tmp_path), 0, [[b"v0"], [b"x" + hidden, b"v2"], [b"v3"]])
    pos1 = SEGMENT_HEADER_V1.size + len(_forged(0, [b"v0"], None, 0))
    flip(path, pos1 + 13)
    log, report = open_log(tmp_path)
    got = read_all(log)
    _no_forgery(got)
    assert got == {0: b"v0"}
    assert report.truncated_bytes == 0 and report.lost_messages >= 3
    assert os.path.exists(f"{path}.damaged-{pos1}")
    assert commit(log, [b"new"])[0] >= 4  # never an offset the damaged records had


# -- damage is damage; only the newest segment's unsynced tail can be torn ----------------


def test_damage_at_the_end_of_a_sealed_segment_is_reported_not_truncated(tmp_path):
    log, _ = open_log(tmp_path, page=4096)
    for i in range(3):
        commit(log, [f"s{i}-0".encode() * 300, f"s{i}-1".encode() * 300])  # a page each
    first = log.segments[0]
    pos, end = first.positions[-1], first.size
    log.close()
    os.unlink(tmp_path / "checkpoint")
    original = _read(first.path)[pos:end]
    flip(first.path, end - 3)  # the last record of a sealed segment
    log, report = open_log(tmp_path, page=4096)
    assert report.truncated_bytes == 0
    assert report.lost_messages == 2 and report.damaged == 2
    assert any("damaged tail" in line for line in report.damage)
    kept = f"{first.path}.damaged-{pos}"
    assert _read(kept)[:-3] == original[:-3] and os.stat(kept).st_mode & 0o777 == 0o600
    assert sorted(read_all(log)) == [2, 3, 4, 5]
    assert log.damaged_messages == 2
    assert commit(log, [b"next"]) == [6]


def test_damage_in_the_newest_segment_is_damage_when_its_offsets_were_published(tmp_path):
    log, _ = open_log(tmp_path)
    for i in range(3):
        commit(log, [f"r{i}-{j}".encode() for j in range(4)])
    log.ack(np.array([0]))
    commit(log)  # the ack log now says offsets up to 12 were given
    seg = log.segments[0]
    pos = seg.positions[-1]
    log.close()
    os.unlink(tmp_path / "checkpoint")
    flip(seg.path, seg.size - 2)
    log, report = open_log(tmp_path)
    assert report.truncated_bytes == 0 and report.lost_messages == 4
    assert os.path.exists(f"{seg.path}.damaged-{pos}")
    assert sorted(read_all(log)) == [1, 2, 3, 4, 5, 6, 7]
    assert commit(log, [b"next"]) == [12]


def test_a_segment_file_shorter_than_its_checkpoint_is_damage(tmp_path):
    log, _ = open_log(tmp_path)
    for i in range(3):
        commit(log, [f"r{i}".encode()] * 2)
    commit(log, checkpoint=True)
    seg = log.segments[0]
    cut = seg.positions[1]
    log.close()
    truncate(seg.path, cut)
    log, report = open_log(tmp_path)
    assert sorted(read_all(log)) == [0, 1] and report.lost_messages == 4
    assert commit(log, [b"next"]) == [6]


def test_a_new_segment_torn_at_creation_is_removed(tmp_path):
    src = tmp_path / "src"
    log, _ = open_log(src)
    commit(log, [b"kept"])
    log.close()
    name = f"{1:020d}.seg"
    for size in (0, 7, 39):
        work = tmp_path / f"size{size}"
        copy_queue(str(src), str(work))
        _write(work / name, b"RAYMQSEG\x02\x00\x00\x00"[:size] + b"\x00" * max(0, size - 12))
        log, report = open_log(work)
        assert name not in segment_files(work)
        assert not os.path.exists(work / f"{name}.damaged")  # torn, not damaged
        assert report.truncated_bytes == size
        assert report.lost_messages == 0 and read_all(log) == {0: b"kept"}
        assert commit(log, [b"next"]) == [1]  # the name is free again
        log.close()


def test_confirm_reads_a_record_checked_and_quarantines_it_if_it_fails(tmp_path):
    """``SegmentLog.confirm``: before a decision taken on properties read without the
    payload CRC, each record holding the offsets is read whole and checked."""
    log, _ = open_log(tmp_path)
    for i in range(3):
        commit(log, [f"c{i}-{j}".encode() for j in range(4)])
    seg = log.segments[0]
    flip(seg.path, seg.positions[1] + RECORD_HEADER.size + 20)  # record 1's payload
    assert log.confirm(np.array([0, 3, 5, 6, 9, 12, 40])).tolist() == [
        True, True, False, False, True, False, False,
    ]  # fmt: skip
    assert log.damaged_messages == 4  # record 1, quarantined and counted once
    assert log.confirm(np.array([4, 8])).tolist() == [False, True]
    assert log.damaged_messages == 4
    assert sorted(read_all(log)) == [0, 1, 2, 3, 8, 9, 10, 11]
    log.close()
