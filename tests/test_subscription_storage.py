"""An address's subscription state on disk, without Ray: ack records tagged with a
subscription id, the checkpoint's subscription section, and recovery merging both."""

from __future__ import annotations

import numpy as np

from raymq.storage import SegmentLog
from raymq.storage.ack_ranges import AckRanges
from raymq.storage.acklog import AckLog, read_ack_log
from raymq.storage.subscriptions import SubscriptionAcks
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


def test_a_queue_has_no_subscription_state(tmp_path):
    log, _ = SegmentLog.open(str(tmp_path), queue="q", page_size_bytes=PAGE)
    commit(log, [b"m"] * 10)
    log.ack(np.arange(0, 5))
    commit(log)
    log.close()
    log, _ = SegmentLog.open(str(tmp_path), queue="q", page_size_bytes=PAGE)
    assert log.recovered_subscriptions is None and log.depth == 5
    log.close()
