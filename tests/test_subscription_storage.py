"""An address's subscription state on disk, without Ray: ack records tagged with a
subscription id, the checkpoint's subscription section, and recovery merging both."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from raymq.errors import StorageError
from raymq.storage import SegmentLog
from raymq.storage.ack_ranges import AckRanges
from raymq.storage.acklog import AckLog, read_ack_log
from raymq.storage.checkpoint import read_checkpoint
from raymq.storage.format import CHECKPOINT_NAME, DamagedFile, frame, unframe
from raymq.storage.subscriptions import (
    MANIFEST_NAME,
    Manifest,
    SubscriptionAcks,
    SubscriptionLog,
    read_manifest,
    write_manifest,
)
from tests.storage_helpers import commit, flip

PAGE = 64 * 1024


def ranges(*pairs) -> np.ndarray:
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def test_tagged_ack_records_round_trip_and_a_damaged_one_loses_only_itself(tmp_path):
    log = AckLog(str(tmp_path), 1)
    log.create(100)
    log.write(ranges((0, 5)), 100, {3: ranges((0, 10), (20, 30)), 7: ranges((5, 6))})
    second = log.size
    log.write(ranges(), 120, {3: ranges((40, 50))})
    log.write(ranges((5, 6)), 130)
    log.close()
    contents = read_ack_log(log.path)
    assert contents.ranges.tolist() == [[0, 5], [5, 6]]
    assert contents.subscriptions[3].tolist() == [[0, 10], [20, 30], [40, 50]]
    assert contents.subscriptions[7].tolist() == [[5, 6]]
    assert contents.high == 130
    flip(log.path, second + 20)  # inside the second record's payload
    damaged = read_ack_log(log.path)
    assert damaged.subscriptions[3].tolist() == [[0, 10], [20, 30]]
    assert damaged.ranges.tolist() == [[0, 5], [5, 6]]


def _address_log(path) -> tuple[SegmentLog, SubscriptionAcks]:
    log, _ = SegmentLog.open(str(path), queue="a", page_size_bytes=PAGE)
    acks = SubscriptionAcks(log)
    log.attach_subscriptions(acks)
    return log, acks


def test_recovery_merges_checkpoint_and_ack_log_ranges_per_subscription(tmp_path):
    log, acks = _address_log(tmp_path)
    acks.create(0, 0)
    acks.create(1, 0)
    commit(log, [b"m"] * 100)
    acks.ack(0, np.arange(0, 30))
    acks.ack(1, np.arange(10, 20))
    commit(log, checkpoint=True)  # into the checkpoint
    acks.ack(0, np.arange(50, 60))
    acks.ack(1, np.arange(0, 10))
    commit(log)  # into the ack log only
    assert log.depth == 80  # 0-19 acknowledged by both
    log.close()
    log, _ = SegmentLog.open(str(tmp_path), queue="a", page_size_bytes=PAGE)
    recovered = log.recovered_subscriptions
    assert recovered[0] == AckRanges.from_ranges(ranges((0, 30), (50, 60)))
    assert recovered[1] == AckRanges.from_ranges(ranges((0, 20)))
    assert log.depth == 80
    log.close()
    # the recovery checkpoint holds them all: they survive the ack logs it retired
    log, _ = SegmentLog.open(str(tmp_path), queue="a", page_size_bytes=PAGE)
    assert log.recovered_subscriptions[0] == recovered[0]
    log.close()


def test_offsets_never_published_are_neither_acknowledged_nor_logged(tmp_path):
    """A negative offset in the ack log would read back as a subscription's marker, one
    past the end as the ack of a message published later."""
    log, acks = _address_log(tmp_path)
    acks.create(0, 0)
    commit(log, [b"m"] * 10)
    assert acks.ack(0, np.array([3, -1, 2, 10, 12])).tolist() == [2, 3]
    commit(log)
    commit(log, [b"m"] * 5)  # offsets 10-14: not acknowledged by anyone
    log.close()
    log, _ = SegmentLog.open(str(tmp_path), queue="a", page_size_bytes=PAGE)
    assert log.recovered_subscriptions[0] == AckRanges.from_ranges(ranges((2, 4)))
    assert log.recovered_subscriptions.keys() == {0}
    log.close()


def test_a_queue_has_no_subscription_state(tmp_path):
    log, _ = SegmentLog.open(str(tmp_path), queue="q", page_size_bytes=PAGE)
    commit(log, [b"m"] * 10)
    log.ack(np.arange(0, 5))
    commit(log)
    log.close()
    log, _ = SegmentLog.open(str(tmp_path), queue="q", page_size_bytes=PAGE)
    assert log.recovered_subscriptions is None and log.depth == 5
    log.close()


# -- framed files: the checkpoint and the subscriptions file -------------------------------


def test_a_framed_file_is_checked_by_one_helper_that_names_the_file(tmp_path):
    body = msgpack.packb({"next_id": 0, "subscriptions": []})
    data = frame(b"RAYMQSUB", 1, body)
    assert unframe(data + b"more", b"RAYMQSUB", 1, "/x/f") == body  # (what follows: ignored)
    broken = {
        "shorter than a header": data[:10],
        "magic": frame(b"RAYMQCKP", 1, body),
        "version 2": frame(b"RAYMQSUB", 2, body),
        "bytes of body": data[:-1],
        "CRC": data[:-1] + bytes([data[-1] ^ 1]),
    }
    for why, bad in broken.items():
        with pytest.raises(DamagedFile, match=f"^/x/f is damaged .*{why}"):
            unframe(bad, b"RAYMQSUB", 1, "/x/f")
    # Both readers say which file, and why.
    write_manifest(str(tmp_path), Manifest({}, 3))
    assert read_manifest(str(tmp_path), "a").next_id == 3
    flip(str(tmp_path / MANIFEST_NAME), 30)
    with pytest.raises(StorageError, match=f"{tmp_path / MANIFEST_NAME} is damaged .*CRC"):
        read_manifest(str(tmp_path), "a")
    (tmp_path / CHECKPOINT_NAME).write_bytes(frame(b"RAYMQCKP", 1, b"\xc1"))  # not msgpack
    ckpt, damage = read_checkpoint(str(tmp_path))
    assert ckpt is None and damage.startswith(f"{tmp_path / CHECKPOINT_NAME} is damaged")


def test_a_subscription_sees_a_record_quarantined_as_acked_before_the_queue_drains_it(
    tmp_path,
):
    """Why ``SubscriptionLog.is_acked`` asks the log too: a read that finds rot
    acknowledges the record in the log at once, and in each subscription only when the
    queue drains the damaged offsets (``ack_everywhere``); until then the delivery code
    must already see them as acknowledged (``SegmentLog.drain_damaged``)."""
    log, acks = _address_log(tmp_path)
    acks.create(0, 0)
    commit(log, [b"a" * 100] * 4)
    commit(log, [b"b" * 100] * 4)
    commit(log, checkpoint=True)  # recovery does not read them again
    path, position = log.segments[0].path, int(log.segments[0].positions[1])
    log.close()
    flip(path, position + 60)
    log, acks = _address_log(tmp_path)
    acks.load(0, log.recovered_subscriptions.get(0), 0)
    view = SubscriptionLog(log, acks, 0)
    assert sum(len(b) for b in view.read(0, 8)) == 4  # the damaged record is taken out
    damaged = np.arange(4, 8)
    assert not acks.acked[0].contains(damaged).any()  # not yet, in the subscription
    assert view.is_acked(damaged).all()
    acks.ack_everywhere(log.drain_damaged())
    assert acks.acked[0].contains(damaged).all()
    log.close()
