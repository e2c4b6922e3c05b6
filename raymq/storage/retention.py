"""An address's retention: acknowledged messages kept on disk for replay, as Kafka keeps
a topic's log, then deleted a whole segment file at a time, oldest first.

Without retention a segment file goes once every subscription has acknowledged all of
it. With ``retention_s`` or ``retention_bytes`` (``QueueConfig``), what every
subscription acknowledged is only *released* (``SubscriptionAcks.released``): the log
keeps it unacknowledged, so a subscription created with ``start="earliest"`` or one
that seeks back gets it again. ``expired_segments`` then names the oldest segments
that may go: wholly released (or acknowledged), older than ``retention_s`` by their
newest record's time (the segment's time index), and leaving at least
``retention_bytes`` of newer segment files; the queue acknowledges them in the log and
the next group commit deletes them. Nothing a subscription has not acknowledged is
ever deleted, nor anything inside either limit; the newest segment always stays (it
keeps the highest offset).
"""

from __future__ import annotations

import datetime

from raymq.errors import InvalidSetting
from raymq.storage.ack_ranges import AckRanges

#: Where a subscription may start or seek: a name, an offset, or a time.
Position = str | int | datetime.datetime


def expired_segments(
    log, released: AckRanges, now_us: int, retention_s: float | None, retention_bytes: int | None
) -> list:
    """The oldest live segments of ``log`` the retention lets go at ``now_us`` (µs since
    the epoch), in order: each stops the walk if it may not go."""
    segments = list(log.segments)
    out = []
    on_disk = sum(s.size for s in segments)
    for seg in segments[:-1]:  # the newest stays
        if retention_s is not None and seg.newest_time > now_us - retention_s * 1e6:
            break  # newer ones are newer still
        if retention_bytes is not None and on_disk - seg.size < retention_bytes:
            break
        left = log.unacked(seg.base_offset, seg.count, seg.end_offset)
        if len(left) and not released.contains(left).all():
            break  # some subscription still needs one of them
        out.append(seg)
        on_disk -= seg.size
    return out


def replay_offset(log, position: object, where: str, setting: str = "start") -> int:
    """The offset a subscription starts or seeks at: ``"latest"`` the next one sent,
    ``"earliest"`` the oldest stored (0: everything older is gone), an offset as it is
    (at most the next one), a ``datetime`` (a naive one is local time) the first record
    stored at or after it, by the segments' time index (the next offset if none).
    ``InvalidSetting`` naming ``where`` and ``setting`` for anything else."""
    if position == "latest":
        return log.next_offset
    if position == "earliest":
        return 0
    if isinstance(position, datetime.datetime):
        time_us = round(position.timestamp() * 1e6)
        for seg in log.segments:
            if seg.newest_time >= time_us:
                found = seg.offset_at(time_us)
                return log.next_offset if found is None else found
        return log.next_offset
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise InvalidSetting(
            f"{setting}={position!r} for {where} is not 'earliest', 'latest', an offset"
            " (int >= 0) or a datetime"
        )
    return min(position, log.next_offset)


__all__ = ["Position", "expired_segments", "replay_offset"]
