"""Replication: a leader's side of a replicated queue, as plain asyncio code.

A replicated queue has one leader (a QueueCore with a ``ReplicationLeader``) and
followers, each holding a copy of the queue's files on its own node
(``raymq.storage.mirror.ReplicaFiles``). Kafka's design, with RayMQ's group commit as
the unit:

- Every group commit is sent, as bytes at positions (``MirrorWrite``), to each follower
  in sync, while the leader writes its own copy. The commit is answered once the leader
  and ``quorum - 1`` followers have it durably; until then its records are not
  published, so nothing is served that the replicas do not have.
- The leader waits for every follower in sync, not only a quorum, up to
  ``FOLLOWER_TIMEOUT_SECONDS``: one that does not answer in time is taken out of the
  in-sync set, and the controller told so, *before* the commit is answered. So every
  in-sync replica the controller knows of holds every answered send, and it may promote
  any of them.
- A follower out of sync is caught up (``catch_up``): cut back to where its history
  agrees with the leader's (epoch history, Kafka's leader-epoch rule), the published
  segment bytes it lacks copied in rounds, then, between two commits, the last bytes and
  the small files (checkpoint, ack logs) installed, and it is in sync again.
- Epochs fence: followers refuse a write of an older epoch (``Fenced``); a leader that
  meets a newer epoch steps down and answers nothing more.

The transport is injected (``FollowerLink``): the Ray shell passes actor calls, tests
pass in-process links.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from raymq.errors import NotEnoughReplicas, NotLeader
from raymq.storage.files import storage_error
from raymq.storage.mirror import (
    EPOCHS_NAME,
    Diverged,
    MirrorState,
    MirrorWrite,
    ReplicaFiles,
    end_of_epoch,
    read_epochs,
    read_range,
    read_small_files,
    write_epochs,
)

log = logging.getLogger("raymq.replication")

#: A follower in sync that has not answered a commit in this long is taken out of the
#: in-sync set (seconds). Kafka's replica.lag.time.max.ms plays the same part.
FOLLOWER_TIMEOUT_SECONDS = 3.0
#: Bytes per chunk when a follower copies segments it lacks.
CATCH_UP_CHUNK_BYTES = 8 * 2**20
#: A catch-up round that copied less than this goes on to install, between two commits.
CATCH_UP_SWITCH_BYTES = 4 * 2**20
#: Pause after a failed catch-up before the next attempt (seconds).
CATCH_UP_RETRY_SECONDS = 0.5
#: The leader writes to idle followers this often, so they know it lives (seconds).
HEARTBEAT_SECONDS = 0.5
#: Longest the last copy of a catch-up may hold commits back (seconds); it is small.
LOCKED_COPY_SECONDS = 10.0


class Fenced(Exception):
    """A follower holds a newer epoch than the leader writing to it."""

    def __init__(self, epoch: int):
        super().__init__(f"epoch {epoch}")
        self.epoch = epoch

    def __reduce__(self):  # crosses Ray calls with its epoch
        return (Fenced, (self.epoch,))


class FollowerLink(Protocol):
    """How a leader reaches one follower (its Ray actor, or an object in tests)."""

    replica_id: str
    node_id: str

    def apply(self, epoch: int, write: MirrorWrite) -> Awaitable[None]:
        """Start writing one commit durably (the call leaves at once); the awaitable
        raises ``Fenced``, ``Diverged`` or another error."""

    def heartbeat(self, epoch: int) -> Awaitable[None]:
        """The leader of ``epoch`` lives; ``Fenced`` if the follower knows a newer one."""

    async def state(self, epoch: int) -> MirrorState:
        """What the copy holds (``Fenced`` as for ``apply``)."""

    async def truncate_to(self, epoch: int, offset: int) -> MirrorState:
        """Cut the copy back to the records before ``offset``."""

    async def write_chunk(
        self, epoch: int, name: str, pos: int, data: np.ndarray, sync: bool
    ) -> None:
        """Copy bytes of a segment file to ``pos``."""

    async def install(
        self,
        epoch: int,
        segments: dict[str, int],
        small_files: dict[str, bytes],
        epochs: list[tuple[int, int]],
        end_offset: int,
        seq: int,
    ) -> None:
        """Finish catching up (``ReplicaFiles.install``)."""


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica of a replicated queue, as its leader sees it (``stats()["replicas"]``)."""

    replica_id: str
    node_id: str
    role: str  # "leader" or "follower"
    in_sync: bool
    #: Messages and bytes of segment files the leader has and the replica does not
    #: (as far as the leader knows).
    lag_messages: int
    lag_bytes: int

    def to_dict(self) -> dict:
        """A plain dict."""
        return {
            "replica_id": self.replica_id,
            "node_id": self.node_id,
            "role": self.role,
            "in_sync": self.in_sync,
            "lag_messages": self.lag_messages,
            "lag_bytes": self.lag_bytes,
        }


@dataclass
class _Follower:
    link: FollowerLink
    in_sync: bool = False
    #: Where the follower's copy ends (next offset), and its segment bytes, as last known.
    end_offset: int = 0
    nbytes: int = 0
    #: Offset this follower's copy is known to agree with the leader's up to: it
    #: answered the commit ending there. Catching up cuts back to at most this.
    agreed: int | None = None
    task: asyncio.Task | None = None
    error: str = ""


@dataclass
class _Round:
    """One commit on its way to the followers."""

    write: MirrorWrite
    first_offset: int
    calls: dict


def _remote_cause(exc: BaseException | None) -> BaseException | None:
    """The follower's own exception inside a remote call's error (Ray wraps it)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc


#: Tells the controller the in-sync set (replica ids) for an epoch; False if that epoch
#: is no longer current (the leader is fenced).
ReportInSync = Callable[[int, list[str]], Awaitable[bool]]


class ReplicationLeader:
    """The leader's side: replicate commits, keep the in-sync set, catch followers up."""

    def __init__(
        self,
        queue: str,
        directory: str,
        *,
        replica_id: str,
        node_id: str,
        epoch: int,
        quorum: int,
        epochs: list[tuple[int, int]],
        report_in_sync: ReportInSync,
        new_epoch: Callable[[], Awaitable[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``report_in_sync`` tells the controller the in-sync set; ``new_epoch`` asks
        it for the next epoch (None: epochs never change here, as in tests)."""
        self.queue = queue
        self.directory = directory
        self.replica_id = replica_id
        self.node_id = node_id
        self.epoch = epoch
        self.quorum = quorum
        #: The epoch history of this copy, this epoch included.
        self.epochs = list(epochs)
        self._report = report_in_sync
        self._clock = clock
        self._followers: dict[str, _Follower] = {}
        #: Held for a whole group commit, and by a catch-up while it installs.
        self.commit_lock = asyncio.Lock()
        self.seq = 0
        self.fenced: NotLeader | None = None
        self._published_sizes: Callable[[], dict[str, int]] = dict
        self._end_offset: Callable[[], int] = lambda: 0
        self._records_end: Callable[[], int] = lambda: 0
        self._last_write = clock()
        self.failed_commits = 0  # refused for want of in-sync replicas
        #: The in-sync set changed and the controller has not been told yet: nothing
        #: is answered until it has.
        self._unreported = False
        self._in_sync_version = 0
        #: Where a new epoch must start (a commit cut back after followers took it).
        self._epoch_from: int | None = None
        self._new_epoch = new_epoch
        self.catch_ups = 0  # followers brought in sync
        #: Restarts in place that found records lost here held by a follower.
        self.stepped_down = 0

    # -- wiring ----------------------------------------------------------------------

    def bind(
        self,
        published_sizes: Callable[[], dict[str, int]],
        end_offset: Callable[[], int],
        records_end: Callable[[], int],
    ) -> None:
        """The queue's log: its published segment sizes (name -> bytes), next offset,
        and the end of its last record (below the next offset when offsets at the end
        were lost to damage or burned)."""
        self._published_sizes, self._end_offset = published_sizes, end_offset
        self._records_end = records_end

    def set_followers(self, links: list[FollowerLink]) -> None:
        """The followers this leader writes to (the controller's choice). New ones
        start out of sync and are caught up; those no longer named are forgotten."""
        wanted = {link.replica_id: link for link in links}
        for rid in list(self._followers):
            if rid not in wanted:
                f = self._followers.pop(rid)
                if f.task is not None:
                    f.task.cancel()
                if hasattr(f.link, "close"):
                    f.link.close()
        for rid, link in wanted.items():
            if rid in self._followers:
                old = self._followers[rid].link
                if old is link or (hasattr(old, "same_as") and old.same_as(link)):
                    continue  # the same follower: its connection and commit in flight stay
                if hasattr(old, "close"):
                    old.close()
                self._followers[rid].link = link
            else:
                self._followers[rid] = _Follower(link)
        self._start_catch_ups()

    async def begin(
        self, epoch: int, links: list[FollowerLink], in_sync: list[str], lost_here: bool
    ) -> bool:
        """Lead in ``epoch``, the controller's next (every start, a restart in place
        too): this copy's epoch starts where its recovered log ends. ``links``: the
        current followers; ``in_sync``: the controller's in-sync set of the epoch
        before; ``lost_here``: recovery lost messages to damage. Returns False if an
        in-sync follower holds records this copy lost (a tail torn by a crash, damage):
        it then steps down, cutting nothing, for the controller to fail over to that
        follower. (Without one, followers are cut back to this copy's end: no two
        copies may serve different messages at an offset.) Leading, it tells the
        controller that it alone is in sync (``NotEnoughReplicas`` if it cannot,
        ``NotLeader`` if its epoch is stale)."""
        self.epoch = epoch
        epochs = read_epochs(self.directory)
        history = list(epochs)
        if not epochs or epochs[-1][0] < epoch:
            epochs.append((epoch, self._end_offset()))
            self._write_epochs(epochs)
        self.epochs = epochs
        holder = await self.holder_of_lost_records(links, in_sync, history, lost_here)
        if holder is not None:
            self.step_down(holder)
            return False
        # Its followers count again once caught up: until then none may be promoted.
        # This copy may hold a tail they lack (sends written here, never answered,
        # before a crash) that it serves from now on; a follower promoted without it
        # would give those offsets to other messages (found by the simulator).
        await self._report_in_sync()
        return True

    async def holder_of_lost_records(
        self,
        links: list[FollowerLink],
        in_sync: list[str],
        history: list[tuple[int, int]],
        lost_here: bool,
    ) -> str | None:
        """After a restart in place: an in-sync follower (``in_sync``: the controller's
        set of the epoch before) that holds records this copy lost, or None. Lost: past
        this copy's last record (a tail torn by a crash) or, when ``lost_here``
        (recovery lost messages to damage), anywhere. ``history``: the epochs before
        this restart's (the new one would end every older epoch at this copy's lossy
        end). A follower's records past where its epoch ends in that history diverged
        and do not count. Followers that do not answer within
        ``FOLLOWER_TIMEOUT_SECONDS`` do not count either."""
        mine = self._records_end()
        asked = [link for link in links if link.replica_id in in_sync]
        states = await asyncio.gather(  # side by side: a silent one costs the bound once
            *(asyncio.wait_for(link.state(self.epoch), FOLLOWER_TIMEOUT_SECONDS) for link in asked),
            return_exceptions=True,
        )
        for link, state in zip(asked, states, strict=True):
            if isinstance(state, BaseException):  # unreachable: its copy cannot help now
                if isinstance(state, asyncio.CancelledError):
                    raise state
                log.info(
                    "queue %r: replica %s not surveyed: %s", self.queue, link.replica_id, state
                )
                continue
            shared_end = min(
                state.end_offset, end_of_epoch(history, state.last_epoch, state.end_offset)
            )
            if shared_end > mine or (lost_here and shared_end > 0):
                return link.replica_id
        return None

    def step_down(self, holder: str) -> NotLeader:
        """Lead no more, cutting nothing: ``holder`` has records this copy lost, and
        the controller's next failover makes the most complete in-sync follower the
        leader (this copy then rejoins as a follower and is caught up from it)."""
        self.fenced = NotLeader(
            f"queue {self.queue!r}: replica {self.replica_id} lost records that replica"
            f" {holder} holds: it steps down instead of cutting them from the followers"
        )
        log.warning("%s", self.fenced)
        self.stepped_down += 1
        return self.fenced

    def _start_catch_ups(self) -> None:
        if self.fenced is not None:
            return
        for f in self._followers.values():
            if not f.in_sync and (f.task is None or f.task.done()):
                f.task = asyncio.get_running_loop().create_task(self._catch_up_loop(f))

    @property
    def in_sync(self) -> list[str]:
        """Replica ids in sync, the leader's first."""
        return [self.replica_id] + sorted(r for r, f in self._followers.items() if f.in_sync)

    def check_leading(self) -> None:
        """Raise ``NotLeader`` once a newer epoch fenced this leader."""
        if self.fenced is not None:
            raise self.fenced

    def _fence(self, epoch: int) -> NotLeader:
        if self.fenced is None:
            self.fenced = NotLeader(
                f"queue {self.queue!r}: replica {self.replica_id} led epoch {self.epoch},"
                f" and epoch {epoch} replaced it: it acknowledges nothing more"
            )
            log.warning("%s", self.fenced)
            for f in self._followers.values():
                if f.task is not None:
                    f.task.cancel()
        return self.fenced

    def statuses(self) -> list[ReplicaStatus]:
        """Each replica as this leader sees it (itself first)."""
        sizes = self._published_sizes()
        total, end = sum(sizes.values()), self._end_offset()
        out = [ReplicaStatus(self.replica_id, self.node_id, "leader", True, 0, 0)]
        for rid in sorted(self._followers):
            f = self._followers[rid]
            lag_m = 0 if f.in_sync else max(0, end - f.end_offset)
            lag_b = 0 if f.in_sync else max(0, total - f.nbytes)
            out.append(ReplicaStatus(rid, f.link.node_id, "follower", f.in_sync, lag_m, lag_b))
        return out

    # -- commits ---------------------------------------------------------------------

    def require_quorum(self) -> None:
        """Refuse a send before anything is stored when too few replicas are in sync
        (``NotEnoughReplicas``); ``NotLeader`` when fenced."""
        self.check_leading()
        have = len(self.in_sync)
        if have < self.quorum:
            raise NotEnoughReplicas(self._short_message(have))

    def _short_message(self, have: int) -> str:
        lagging = [
            f"{rid} ({f.error or 'catching up'})"
            for rid, f in sorted(self._followers.items())
            if not f.in_sync
        ]
        return (
            f"queue {self.queue!r}: {have} of {len(self._followers) + 1} replicas in sync,"
            f" min_insync_replicas={self.quorum}; out of sync: {', '.join(lagging) or 'none'}"
        )

    def start(self, write: MirrorWrite, first_offset: int) -> _Round:
        """Send one commit (``write``, whose records start at ``first_offset``) to every
        follower in sync, at once (the leader writes its own copy meanwhile); ``finish``
        waits for them."""
        self.check_leading()
        self.seq += 1
        write.seq, write.epoch = self.seq, self.epoch
        self._last_write = self._clock()
        calls = {
            asyncio.ensure_future(f.link.apply(self.epoch, write)): f
            for f in self._followers.values()
            if f.in_sync
        }
        return _Round(write, first_offset, calls)

    async def finish(self, round: _Round) -> None:
        """Wait for the followers of a commit up to ``FOLLOWER_TIMEOUT_SECONDS``. Those
        that fail or are late leave the in-sync set (the controller is told first).
        Raises ``NotEnoughReplicas`` if fewer than the quorum have it, ``NotLeader``
        if a newer epoch fenced this leader."""
        write, calls = round.write, round.calls
        done, late = (set(), set())
        if calls:
            done, late = await asyncio.wait(calls, timeout=FOLLOWER_TIMEOUT_SECONDS)
        dropped: list[_Follower] = []
        newest = 0
        for fut, f in calls.items():
            if fut in late:
                fut.cancel()
                f.error = f"no answer to a commit in {FOLLOWER_TIMEOUT_SECONDS:.0f} s"
                dropped.append(f)
                continue
            exc = _remote_cause(fut.exception())
            if isinstance(exc, Fenced):
                newest = max(newest, exc.epoch)
            elif exc is not None:
                f.error = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, Diverged):  # it agrees up to what was published
                    f.agreed = round.first_offset
                dropped.append(f)
            else:
                f.end_offset, f.agreed = write.end_offset, write.end_offset
                f.nbytes += write.nbytes
        if newest:
            raise self._fence(newest)
        if dropped:
            for f in dropped:
                f.in_sync = False
                log.warning(
                    "queue %r: replica %s out of sync: %s", self.queue, f.link.replica_id, f.error
                )
            self._in_sync_changed()
            self._start_catch_ups()
        if self._unreported:
            await self._report_in_sync()
        have = len(self.in_sync)
        if have < self.quorum:
            self.failed_commits += 1
            raise NotEnoughReplicas(self._short_message(have))

    async def replicate(self, write: MirrorWrite, first_offset: int) -> None:
        """``start`` then ``finish``."""
        await self.finish(self.start(write, first_offset))

    def _in_sync_changed(self) -> None:
        self._unreported = True
        self._in_sync_version += 1

    async def _report_in_sync(self) -> None:
        """Tell the controller the in-sync set; fenced if it knows a newer epoch.
        Until it was told, ``_unreported`` stays set and no commit is answered; a
        report of a set changed since it left does not clear it."""
        self._unreported = True
        version = self._in_sync_version
        try:
            current = await self._report(self.epoch, self.in_sync)
        except Exception as exc:  # cannot shrink the set: nothing may be answered
            raise NotEnoughReplicas(
                f"queue {self.queue!r}: the controller could not be told the in-sync"
                f" replicas ({exc!r})"
            ) from exc
        if not current:
            raise self._fence(self.epoch + 1)
        if version == self._in_sync_version:
            self._unreported = False

    async def abandon(self, round: _Round) -> bool:
        """The leader cut back a commit it had sent (its own write failed, or too few
        replicas had it): the followers that took it hold records the leader will give
        other messages to. They leave the in-sync set, to be cut back to where the
        commit started; the controller is told, and this leader takes a new epoch
        starting there before its next commit, so that any later leader cuts them back
        too. Returns False if the controller could not be told: a follower it still
        counts in sync may hold the commit, whose outcome is then unknown."""
        changed = False
        for f in round.calls.values():
            f.agreed = round.first_offset if f.agreed is None else min(f.agreed, round.first_offset)
            if f.in_sync:
                f.in_sync, f.error, changed = False, "holds a commit the leader cut back", True
        if round.calls:
            start = round.first_offset
            self._epoch_from = start if self._epoch_from is None else min(self._epoch_from, start)
        if not changed:
            return True
        self._in_sync_changed()
        self._start_catch_ups()
        try:
            await self._report_in_sync()
        except (NotEnoughReplicas, NotLeader):
            return False
        return True

    @property
    def needs_epoch(self) -> bool:
        """A commit was cut back after followers took it: a new epoch must start before
        the next commit (``renew_epoch``)."""
        return self._epoch_from is not None

    async def renew_epoch(self) -> None:
        """Start a new epoch (the controller's next) at the offset where a cut-back
        commit started; ``NotEnoughReplicas`` if the controller cannot be reached."""
        if self._new_epoch is None:
            self._epoch_from = None
            return
        try:
            epoch = await self._new_epoch()
        except NotLeader:
            raise
        except Exception as exc:
            raise NotEnoughReplicas(
                f"queue {self.queue!r}: no new epoch from the controller after a cut-back"
                f" commit ({exc!r})"
            ) from exc
        # Adopted once on disk: a failed write leaves the cut-back pending, and the next
        # commit asks again (the epoch given is burned; the controller's is newer).
        epochs = [*self.epochs, (epoch, self._epoch_from)]
        self._write_epochs(epochs)
        self.epoch, self.epochs, self._epoch_from = epoch, epochs, None

    def _write_epochs(self, epochs: list[tuple[int, int]]) -> None:
        """``write_epochs``, a failure raised as ``StorageError`` naming the file."""
        try:
            write_epochs(self.directory, epochs)
        except OSError as exc:
            path = os.path.join(self.directory, EPOCHS_NAME)
            raise storage_error(self.queue, "writing the epoch history", path, exc) from exc

    async def heartbeat_loop(self) -> None:
        """Write to idle followers every ``HEARTBEAT_SECONDS`` (they report a silent
        leader to the controller); a follower that knows a newer epoch fences us."""
        while self.fenced is None:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            if self._clock() - self._last_write >= HEARTBEAT_SECONDS:
                await self.heartbeat_once()

    async def heartbeat_once(self) -> None:
        """One round of heartbeats to every follower: those that do not answer leave
        the in-sync set (``_lose_in_sync``); one that knows a newer epoch fences us."""
        followers = list(self._followers.values())
        results = await asyncio.gather(
            *(
                asyncio.wait_for(f.link.heartbeat(self.epoch), FOLLOWER_TIMEOUT_SECONDS)
                for f in followers
            ),
            return_exceptions=True,
        )
        causes = [_remote_cause(r) if isinstance(r, BaseException) else None for r in results]
        newest = max((c.epoch for c in causes if isinstance(c, Fenced)), default=0)
        if newest:
            self._fence(newest)
            return
        lost = [(f, c) for f, c in zip(followers, causes, strict=True) if c is not None]
        if lost:
            await self._lose_in_sync(lost)

    async def _lose_in_sync(self, lost: list[tuple[_Follower, BaseException]]) -> None:
        """In-sync followers that did not answer a heartbeat leave the in-sync set at
        once (between two commits; the controller is told), not at the next commit."""
        async with self.commit_lock:
            changed = False
            for f, cause in lost:
                if f.in_sync and f in self._followers.values():
                    f.in_sync, changed = False, True
                    f.error = f"no answer to a heartbeat: {type(cause).__name__}: {cause}"
                    log.warning(
                        "queue %r: replica %s out of sync: %s",
                        self.queue,
                        f.link.replica_id,
                        f.error,
                    )
            if changed:
                self._in_sync_changed()
                self._start_catch_ups()
                with contextlib.suppress(NotEnoughReplicas, NotLeader):
                    await self._report_in_sync()

    # -- catching up -----------------------------------------------------------------

    async def _catch_up_loop(self, f: _Follower) -> None:
        while self.fenced is None and not f.in_sync:
            try:
                await self.catch_up(f)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # unreachable, a full disk...: tried again
                cause = _remote_cause(exc)
                if isinstance(cause, Fenced):
                    self._fence(cause.epoch)
                    return
                f.error = f"{type(exc).__name__}: {exc}"
                log.info(
                    "queue %r: catching up replica %s failed: %s",
                    self.queue,
                    f.link.replica_id,
                    f.error,
                )
                await asyncio.sleep(CATCH_UP_RETRY_SECONDS)

    async def catch_up(self, f: _Follower) -> None:
        """Bring one follower in sync (see the module docstring)."""
        link = f.link
        state = await link.state(self.epoch)
        # Kafka's rule: where the follower's newest epoch ends in this leader's history
        # (this leader's end, if it is the current one); never past what it is known to
        # share. Always cut: that also drops a torn or stale tail after its last record.
        # A follower never keeps records past this leader's last one either (its own
        # copy of them was lost): its files must be prefixes of the leader's.
        ends = end_of_epoch(self.epochs, state.last_epoch, self._end_offset())
        cut = min(state.end_offset, ends, self._records_end())
        if f.agreed is not None:
            cut = min(cut, f.agreed)
        state = await link.truncate_to(self.epoch, cut)
        have = dict(state.segments)
        f.end_offset, f.nbytes = state.end_offset, state.nbytes
        while True:  # rounds of bulk copying, commits going on meanwhile
            copied = await self._copy_missing(f, have, self._published_sizes())
            if copied < CATCH_UP_SWITCH_BYTES:
                break
        async with self.commit_lock:  # no commit in flight: the copy can be complete
            sizes = self._published_sizes()
            # Every commit waits for this: a follower that stops answering must not
            # stall the queue (the loop tries again).
            await asyncio.wait_for(self._copy_missing(f, have, sizes), LOCKED_COPY_SECONDS)
            small = await asyncio.to_thread(read_small_files, self.directory)
            end = self._end_offset()
            await asyncio.wait_for(
                link.install(self.epoch, sizes, small, self.epochs, end, self.seq),
                FOLLOWER_TIMEOUT_SECONDS,
            )
            f.in_sync, f.error = True, ""
            f.end_offset, f.agreed, f.nbytes = end, end, sum(sizes.values())
            self.catch_ups += 1
        log.info("queue %r: replica %s in sync", self.queue, link.replica_id)
        # If this fails the controller's set stays a subset of ours (safe); told again
        # with the next change.
        with contextlib.suppress(NotEnoughReplicas):
            await self._report_in_sync()

    async def _copy_missing(self, f: _Follower, have: dict[str, int], sizes: dict[str, int]) -> int:
        """Copy what the follower lacks of each published segment; returns bytes copied."""
        copied = 0
        for name in sorted(sizes):
            size, start = sizes[name], have.get(name, 0)
            if start > size:  # cut back on the leader since: the follower follows
                raise Diverged(f"{name}: the copy has {start} bytes, the leader {size}")
            path = os.path.join(self.directory, name)
            while start < size:
                end = min(size, start + CATCH_UP_CHUNK_BYTES)
                data = await asyncio.to_thread(read_range, path, start, end)
                await f.link.write_chunk(self.epoch, name, start, data, end == size)
                copied += end - start
                f.nbytes += end - start
                start = have[name] = end
        return copied

    def close(self) -> None:
        """Stop catching followers up."""
        for f in self._followers.values():
            if f.task is not None:
                f.task.cancel()


class ReplicationFollower:
    """A follower's side: epoch checks around its ``ReplicaFiles``, and when it last
    heard from its leader."""

    def __init__(
        self, files: ReplicaFiles, epoch: int, clock: Callable[[], float] = time.monotonic
    ):
        self.files = files
        #: The newest epoch this follower was told of; older leaders are refused. Kept
        #: on disk: a restarted follower still refuses them.
        self.epoch = max(epoch, files.read_fence(), files.last_epoch)
        self._clock = clock
        self.heard = clock()
        self.applied_commits = 0
        self.applied_bytes = 0
        self.retired = False

    def retire(self) -> None:
        """Refuse every leader from now on (this copy is handed over)."""
        self.retired = True

    def _check(self, epoch: int) -> None:
        if epoch < self.epoch or self.retired:
            raise Fenced(max(self.epoch, epoch + 1) if self.retired else self.epoch)
        self._raise_to(epoch)
        self.heard = self._clock()

    def _raise_to(self, epoch: int) -> None:
        if epoch > self.epoch:
            self.files.write_fence(epoch)  # durable before anything is answered
            self.epoch = epoch

    def fence(self, epoch: int) -> MirrorState:
        """The controller starts ``epoch``: writes of older epochs are refused from now
        on. Returns what this copy holds (the controller promotes the most complete)."""
        self._raise_to(epoch)
        return self.files.state()

    def silent_for(self) -> float:
        """Seconds since the leader last wrote (or since this follower started)."""
        return self._clock() - self.heard

    def apply(self, epoch: int, write: MirrorWrite) -> None:
        """``ReplicaFiles.apply`` for the leader of ``epoch``."""
        self._check(epoch)
        self.files.apply(write)
        self.applied_commits += 1
        self.applied_bytes += write.nbytes

    def heartbeat(self, epoch: int) -> None:
        """The leader of ``epoch`` lives."""
        self._check(epoch)

    def state(self, epoch: int) -> MirrorState:
        """``ReplicaFiles.state``."""
        self._check(epoch)
        return self.files.state()

    def truncate_to(self, epoch: int, offset: int) -> MirrorState:
        """``ReplicaFiles.truncate_to``; returns the state after it."""
        self._check(epoch)
        self.files.truncate_to(offset)
        return self.files.state()

    def write_chunk(self, epoch: int, name: str, pos: int, data: np.ndarray, sync: bool) -> None:
        """``ReplicaFiles.write_chunk``."""
        self._check(epoch)
        self.files.write_chunk(name, pos, data, sync=sync)

    def install(
        self,
        epoch: int,
        segments: dict[str, int],
        small_files: dict[str, bytes],
        epochs: list[tuple[int, int]],
        end_offset: int,
        seq: int,
    ) -> None:
        """``ReplicaFiles.install``."""
        self._check(epoch)
        self.files.install(segments, small_files, epochs, end_offset, seq)
