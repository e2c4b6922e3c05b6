"""The replicated commit path: what a group commit of a replicated queue does besides
writing its own files.

A new epoch first when a commit was cut back after followers took it; the prepared
write mirrored to the followers in sync; their answers awaited before anything is
answered; and a commit cut back told to the controller, since followers may hold it.
"""

from __future__ import annotations

from raymq.core.replication import ReplicationLeader, _Round
from raymq.errors import BrokerUnavailable, NotEnoughReplicas, NotLeader
from raymq.storage import PreparedWrite, SegmentLog
from raymq.storage.mirror import mirror_write


class ReplicatedCommit:
    """One leader's commits on their way to its followers (``ReplicationLeader``)."""

    def __init__(self, replication: ReplicationLeader, log: SegmentLog, queue: str):
        self.replication = replication
        self.log = log
        self.queue = queue

    async def renew_epoch(self) -> NotEnoughReplicas | NotLeader | None:
        """A new epoch if a commit was cut back after followers took it; returns why
        the commit may not go on (None: it may)."""
        if not self.replication.needs_epoch:
            return None
        try:
            await self.replication.renew_epoch()
        except (NotEnoughReplicas, NotLeader) as exc:
            return exc
        return None

    def start(self, prepared: PreparedWrite) -> _Round | None:
        """Send a prepared commit to the followers in sync (None: nothing to send)."""
        log = self.log
        write = mirror_write(prepared, log.take_deleted_names(), log.planned_next)
        if not (write.records or write.ack_record or write.checkpoint or write.deleted):
            return None
        first = prepared.items[0][3].first_offset if prepared.items else log.next_offset
        return self.replication.start(write, first)

    async def finish(
        self, round: _Round, has_records: bool
    ) -> tuple[Exception | None, NotLeader | None]:
        """Wait for the followers' answers; returns (why the records may not be
        answered as stored, the fencing of a replaced leader), None where all is well.

        Acks stay (durable here; a follower that missed them is caught up); records too
        few replicas have are cut back, never served. A leader replaced answers nothing
        as durable, acks included."""
        try:
            await self.replication.finish(round)
        except (NotEnoughReplicas, NotLeader) as exc:
            return (exc if has_records else None), (exc if isinstance(exc, NotLeader) else None)
        return None, None

    async def abandon(self, round: _Round) -> bool:
        """Give up a round (its commit failed here); False if the controller could not
        be told which replicas hold it."""
        return await self.replication.abandon(round)

    async def cut_back(self, round: _Round, cause: BaseException) -> BrokerUnavailable | None:
        """Tell the controller that a commit's records were cut back (followers may hold
        them); the error to answer instead of ``cause`` if it could not be told."""
        if await self.abandon(round):
            return None
        return BrokerUnavailable(
            f"queue {self.queue!r}: a send failed ({cause}) and the controller could not"
            " be told which replicas hold it: it may be delivered later"
        )


__all__ = ["ReplicatedCommit"]
