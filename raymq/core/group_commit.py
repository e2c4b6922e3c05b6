"""GroupCommit: a queue's send/commit pipeline.

Sends wait in ``pending`` and ack flushes in ``ack_waiters``; one writer task takes
them all, prepares one write (records, acks, maybe a checkpoint), writes it with one
fdatasync, sends it to the followers of a replicated queue (``ReplicatedCommit``),
publishes it or cuts it back, and answers every caller.

Interleaving: ``submit`` and ``flush`` interleave with each other and with the writer
at their ``await``; only the writer touches the log's write path, so at most one write
is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.replicated_commit import ReplicatedCommit
from raymq.core.replication import ReplicationLeader, _Round
from raymq.errors import DurabilityUnknown, NotLeader, StorageError
from raymq.storage import PreparedWrite, SegmentLog

log = logging.getLogger("raymq.queue")

#: Group commits up to this many bytes are written in the event loop, unless they take
#: a checkpoint (bytes).
INLINE_WRITE_BYTES = 256 * 1024
#: Longest delivery counts wait for a commit that writes the ack log anyway (seconds).
#: Each take records one; if every send's commit also wrote them, a message taken one
#: at a time would cost its queue two fdatasyncs a commit (segment and ack log). A
#: crash loses at most this much of them (counted as fewer deliveries, never more).
COUNTS_LINGER_SECONDS = 0.05


class CommitHost(Protocol):
    """What the pipeline needs of the queue it commits for (``QueueCore``): named here
    so that this module does not import the queue's (no import cycle)."""

    name: str
    config: QueueConfig
    broker: BrokerConfig
    log: SegmentLog
    replication: ReplicationLeader | None

    async def after_commit(self, prepared: PreparedWrite) -> None: ...
    def count(self, counter: str, n: int) -> None: ...
    def commit_done(self, stored_messages: bool) -> None: ...


class GroupCommit:
    """Concurrent sends and ack flushes share one write and one fdatasync."""

    def __init__(self, host: CommitHost):
        self.host = host
        replication = host.replication
        self.replicated = (
            None if replication is None else ReplicatedCommit(replication, host.log, host.name)
        )
        self.pending: list[tuple[MessageBatch, asyncio.Future]] = []
        self.ack_waiters: list[asyncio.Future] = []
        self.kick: asyncio.Event | None = None  # set: the writer has work
        #: True while a group commit runs (its batches are out of ``pending`` then, and
        #: a large write awaits a thread): ``close`` and ``busy`` must wait for it.
        self.committing = False
        self.group_commits = 0  # commits that stored messages (QueueStats.group_commits)
        #: Failures after a commit was durable (deriving indexes, unlinking files): the
        #: sends succeeded; each is logged. Counted here.
        self.internal_errors = 0
        self.dirty_since_checkpoint = False
        self.last_checkpoint = time.monotonic()
        #: When a commit last took the pending delivery counts (``time.monotonic``).
        self.counts_written = self.last_checkpoint
        #: Callers of ``checkpoint``: answered by the next commit's checkpoint.
        self.checkpoint_waiters: list[asyncio.Future] = []

    def start(self) -> None:
        """Ready the writer's wake-up, on the running event loop."""
        self.kick = asyncio.Event()

    @property
    def started(self) -> bool:
        """True once ``start`` ran."""
        return self.kick is not None

    @property
    def busy(self) -> bool:
        """True while sends wait for a commit or a commit runs."""
        return bool(self.pending) or self.committing

    def wake(self) -> None:
        """Make the writer commit now (a checkpoint of an idle queue, acks to retry)."""
        self.kick.set()

    async def submit(self, batch: MessageBatch) -> int:
        """Commit ``batch`` with the next group commit; returns its first offset once
        it is durable (replicated, for a replicated queue)."""
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((batch, fut))
        self.kick.set()
        return await fut

    async def flush(self) -> None:
        """Return once the acks applied so far are durable (the next group commit)."""
        fut = asyncio.get_running_loop().create_future()
        self.ack_waiters.append(fut)  # resolved by the commit that takes them all
        self.kick.set()
        await fut

    async def checkpoint(self) -> None:
        """Return once a checkpoint holding everything applied so far is durable (a
        subscription's seek: an ack record can only add); ``StorageError`` if it failed."""
        fut = asyncio.get_running_loop().create_future()
        self.checkpoint_waiters.append(fut)
        self.kick.set()
        await fut

    async def run(self) -> None:
        """The writer: one group commit each time it is woken."""
        while True:
            await self.kick.wait()
            self.kick.clear()
            await self.commit_once()
            # One turn of the loop before the next commit: the fetches its ``wake``
            # woke deliver first, rather than after another write and fdatasync.
            await asyncio.sleep(0)

    async def commit_once(self) -> None:
        """One group commit of what is pending. Whatever happens, every caller waiting
        on it gets an answer (an error at worst): none waits for ever."""
        pending, self.pending = self.pending, []
        waiters, self.ack_waiters = self.ack_waiters, []
        self.committing = True
        try:
            await self._commit(pending, waiters)
        except BaseException as exc:
            for fut in [f for _, f in pending] + waiters:
                if not fut.done():
                    if isinstance(exc, Exception):
                        fut.set_exception(exc)
                    else:
                        fut.cancel()
            raise
        finally:
            self.committing = False

    async def _commit(self, pending: list, waiters: list[asyncio.Future]) -> None:
        replication = self.host.replication
        if replication is None:
            await self._commit_here(pending, waiters)
        else:  # a catch-up installs between two commits
            async with replication.commit_lock:
                await self._commit_here(pending, waiters)

    async def _commit_here(self, pending: list, waiters: list[asyncio.Future]) -> None:
        """Write, replicate, publish (or cut back) and answer one group commit."""
        asked, self.checkpoint_waiters = self.checkpoint_waiters, []
        written = False
        try:
            written = await self._commit_with(pending, waiters, asked)
        finally:
            for fut in asked:
                if fut.done():
                    continue
                if written:
                    fut.set_result(None)
                else:
                    fut.set_exception(
                        StorageError(f"queue {self.host.name!r}: the checkpoint was not written")
                    )

    async def _commit_with(
        self, pending: list, waiters: list[asyncio.Future], asked: list[asyncio.Future]
    ) -> bool:
        """``_commit_here``'s work; True if it wrote a checkpoint."""
        checkpoint = self._checkpoint_due() or (bool(asked) and self.host.config.durable)
        if self.replicated is not None:
            # A commit was cut back after followers took it: a new epoch first.
            refused = await self.replicated.renew_epoch()
            if refused is not None:
                _fail(pending, waiters, refused)
                return
        written = await self._write(pending, waiters, checkpoint)
        if written is None:  # refused, or a bug: every caller has its answer
            return False
        prepared, replicating = written
        stored, unreplicated, fenced = await self._publish(prepared, replicating)
        await self._answer_senders(pending, prepared, stored, unreplicated)
        self._note_checkpoint(prepared, bool(pending) and stored, bool(waiters))
        _answer_ack_waiters(waiters, prepared, fenced)
        self.host.commit_done(stored and bool(prepared.items))
        if prepared.checkpoint_error is not None:
            error = prepared.checkpoint_error
            if prepared.checkpoint_unsynced:  # written: in effect, maybe not durable
                error = DurabilityUnknown(f"{error} (the checkpoint may not outlive a crash)")
            for fut in asked:
                fut.set_exception(error)
        return prepared.checkpoint_written or not self.host.config.durable

    def _checkpoint_due(self) -> bool:
        """True if this commit writes a checkpoint (durable, changed, and none for
        ``checkpoint_interval`` seconds)."""
        host = self.host
        return (
            host.config.durable
            and self.dirty_since_checkpoint
            and time.monotonic() - self.last_checkpoint >= host.broker.checkpoint_interval
        )

    async def _write(
        self, pending: list, waiters: list[asyncio.Future], checkpoint: bool
    ) -> tuple[PreparedWrite, _Round | None] | None:
        """Prepare the commit, start its replication and write it; returns it with its
        round (None: no round), or None once every caller was answered with an error."""
        log_, host = self.host.log, self.host
        prepared: PreparedWrite | None = None
        replicating: _Round | None = None
        try:
            batches = [b for b, _ in pending]
            now = time.monotonic()
            # Counts ride along with a send's commit only every COUNTS_LINGER_SECONDS;
            # a commit nobody's send waits for, or a flush, takes them at once.
            counts = (
                not batches or bool(waiters) or now - self.counts_written >= COUNTS_LINGER_SECONDS
            )
            prepared = log_.prepare(
                batches, int(time.time() * 1e6), checkpoint=checkpoint, counts=counts
            )
            if prepared.deliveries:
                self.counts_written = now
            if self.replicated is not None:
                replicating = self.replicated.start(prepared)
            to_disk = any(item[2] for item in prepared.items)  # transient ones may flow
            if host.config.durable or to_disk or prepared.ack_ranges is not None:
                if prepared.write_bytes <= INLINE_WRITE_BYTES and prepared.checkpoint is None:
                    # A small write and its fdatasync take well under a millisecond: doing
                    # them inline saves a thread hand-off, and sends arriving meanwhile
                    # wait in Ray's queue and join the next group commit anyway. Not a
                    # checkpoint's (a new ack log, a staged file, a rename: five syncs,
                    # 4.6 ms on average and up to 16 ms on our machines, once a second):
                    # in a thread, the queue delivers what was published meanwhile.
                    log_.write(prepared)
                else:
                    await asyncio.to_thread(log_.write, prepared)
        except StorageError as exc:
            if prepared is None:  # refused before anything was planned
                _fail(pending, waiters, exc)
                return None
            # Otherwise each part's outcome is in ``prepared``: publish sorts it out.
        except Exception as exc:  # a bug: fail the callers, not the loop
            if prepared is not None:
                log_.abort(prepared)
            if replicating is not None:
                await self.replicated.abandon(replicating)
            _fail(pending, waiters, exc)
            return None
        return prepared, replicating

    async def _publish(
        self, prepared: PreparedWrite, replicating: _Round | None
    ) -> tuple[bool, Exception | None, NotLeader | None]:
        """Wait for the followers, then publish the commit or cut it back; returns
        (its records are stored, why they were cut back, the fencing of a replaced
        leader)."""
        unreplicated: Exception | None = None
        fenced: NotLeader | None = None
        if replicating is not None:
            unreplicated, fenced = await self.replicated.finish(replicating, bool(prepared.items))
        if unreplicated is not None:
            self.host.log.abort(prepared)
        else:
            self.host.log.publish(prepared)
        stored = prepared.records_error is None and unreplicated is None
        if replicating is not None and prepared.items and not stored:
            cause = prepared.records_error or unreplicated
            untold = await self.replicated.cut_back(replicating, cause)  # followers may hold them
            if untold is not None:
                unreplicated = untold
        return stored, unreplicated, fenced

    async def _answer_senders(
        self,
        pending: list,
        prepared: PreparedWrite,
        stored: bool,
        unreplicated: Exception | None,
    ) -> None:
        """Derive the queue's state from a durable commit and give each sender its first
        offset; or fail the senders of a commit cut back (never served; they may retry)."""
        host = self.host
        if not stored:
            _fail(pending, [], unreplicated or prepared.records_error)
            return
        try:  # the commit is durable: what follows derives state, it cannot undo it
            await host.after_commit(prepared)
        except Exception:
            self.internal_errors += 1
            log.exception("queue %r: after a durable commit", host.name)
        for (_, fut), first in zip(pending, prepared.firsts, strict=True):
            if not fut.done():
                fut.set_result(first)
        if prepared.items:
            self.group_commits += 1
        host.count("in", prepared.message_count)
        host.count("bytes_in", sum(item[3].nbytes for item in prepared.items))

    def _note_checkpoint(self, prepared: PreparedWrite, stored: bool, acks: bool) -> None:
        """Note a checkpoint written, and changes (records ``stored``, ``acks``) that the
        next checkpoint must hold."""
        if prepared.checkpoint_written:
            self.last_checkpoint = time.monotonic()
            self.dirty_since_checkpoint = False
        if stored or acks:
            self.dirty_since_checkpoint = True


def _answer_ack_waiters(
    waiters: list[asyncio.Future], prepared: PreparedWrite, fenced: NotLeader | None
) -> None:
    """An ack is durable once in the ack log; if that failed it stays applied and is
    written again with a later commit (the housekeeping retries). A leader replaced
    answers nothing as durable."""
    for fut in waiters:
        if not fut.done():
            if fenced is not None:
                fut.set_exception(fenced)
            elif prepared.ack_error is None:
                fut.set_result(None)
            else:
                fut.set_exception(prepared.ack_error)


def _fail(pending: list, waiters: list[asyncio.Future], exc: BaseException) -> None:
    """Answer every sender of ``pending`` and every ack waiter with ``exc``."""
    for fut in [f for _, f in pending] + waiters:
        if not fut.done():
            fut.set_exception(exc)


__all__ = ["COUNTS_LINGER_SECONDS", "INLINE_WRITE_BYTES", "CommitHost", "GroupCommit"]
