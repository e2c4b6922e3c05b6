"""ReplicaActor: one follower of a replicated queue, wrapping
``raymq.core.replication.ReplicationFollower`` over its ``ReplicaFiles``.

Named ``raymq.replica.<queue>.<replica id>``, detached, pinned to the node whose disk
holds its copy (never the node of another replica of the queue), restarted in place if
its process dies (it reads its files again and is caught up by its leader).

Its methods are plain functions: they run one at a time, in the order the leader's calls
arrive, each writing and fsyncing before it answers. A watch task reports a leader that
stopped writing (no commit and no heartbeat for ``LEADER_SILENCE_SECONDS``) to the
broker's controller, which checks and fails over.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import numpy as np
import ray
from raymq.actors.names import BROKER_ACTOR_NAME

from raymq.core.replication import ReplicationFollower
from raymq.heap import freeze_startup_heap
from raymq.storage.mirror import MirrorState, MirrorWrite, ReplicaFiles
from raymq.wire.errors import WireBroken
from raymq.wire.replica import ReplicaChannel, ReplicaServer

#: A leader silent this long is reported to the controller (seconds); it writes to
#: idle followers every ``replication.HEARTBEAT_SECONDS``.
LEADER_SILENCE_SECONDS = 1.5

log = logging.getLogger("raymq.replica")


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class ReplicaActor:
    """The Ray shell of one follower."""

    def __init__(self, queue: str, replica_id: str, directory: str, epoch: int, namespace: str):
        self.queue = queue
        self.replica_id = replica_id
        self.namespace = namespace
        self.follower = ReplicationFollower(ReplicaFiles(directory, queue), epoch)
        self._watch: asyncio.Task | None = None
        self._channel = ReplicaServer(self.follower, queue)
        #: The channel's start, once asked (its endpoint, or None: no channel).
        self._channel_start: asyncio.Future | None = None
        # Here, not only in ready(): a process Ray restarts after a crash runs this
        # again, but nobody may call its ready() (the controller's wake went to the
        # process that died).
        freeze_startup_heap()

    def _ensure_watch(self) -> None:
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_leader())

    async def _watch_leader(self) -> None:
        """Report a silent leader to the controller (which checks it and fails over);
        again every ``LEADER_SILENCE_SECONDS`` while it stays silent."""
        while True:
            await asyncio.sleep(LEADER_SILENCE_SECONDS / 3)
            if self.follower.silent_for() < LEADER_SILENCE_SECONDS:
                continue
            try:
                broker = ray.get_actor(BROKER_ACTOR_NAME, namespace=self.namespace)
                broker.leader_silent.remote(self.queue, self.follower.epoch)
            except Exception as exc:  # the broker restarts: its own monitor still checks
                log.info("queue %r: could not report a silent leader: %s", self.queue, exc)
            self.follower.heard = self.follower._clock()  # not again before another period

    async def ready(self) -> MirrorState:
        """What this copy holds, once its files are open."""
        self._ensure_watch()
        await self.endpoint()
        freeze_startup_heap()  # a replicated commit waits on this process too (raymq.heap)
        return self.follower.files.state()

    async def endpoint(self) -> tuple[str, int, str] | None:
        """(host, port, secret) of this follower's ReplicaChannel (None: it has none;
        its leader then writes through Ray calls). Calls made while it starts wait for
        it: the controller's ``ready()`` and the leader's first write come together, and
        a None to the leader would keep it on Ray calls for good."""
        if self._channel_start is None:
            self._channel_start = asyncio.ensure_future(self._start_channel())
        return await asyncio.shield(self._channel_start)

    async def _start_channel(self) -> tuple[str, int, str] | None:
        try:
            return await self._channel.start(ray.util.get_node_ip_address())
        except Exception as exc:  # shared by every caller: a None, never a stored error
            log.warning("queue %r: replica %s has no channel: %r", self.queue, self.replica_id, exc)
            return None

    def ping(self) -> int:
        """The epoch this follower knows (for the controller's liveness checks)."""
        return self.follower.epoch

    def pid(self) -> int:
        """The actor's process id (for fault tests and diagnostics)."""
        return os.getpid()

    def node_id(self) -> str:
        """The node this replica's copy lives on."""
        return ray.get_runtime_context().get_node_id()

    # -- the controller ----------------------------------------------------------------

    def fence(self, epoch: int) -> MirrorState:
        """Refuse writes of epochs before ``epoch`` from now on; what this copy holds."""
        return self.follower.fence(epoch)

    def release(self) -> MirrorState:
        """Close the files and take nothing more (this copy is about to be opened as the
        queue's leader, by another process)."""
        self.follower.retire()
        self._channel.close()
        self.follower.files.close()
        if self._watch is not None:
            self._watch.cancel()
        return self.follower.files.state()

    def shutdown(self, delete_files: bool = False) -> None:
        """Close the files and optionally delete this copy's directory."""
        self.release()
        if delete_files:
            import shutil

            shutil.rmtree(self.follower.files.directory, ignore_errors=True)

    def stats(self) -> dict:
        """This follower's counters."""
        f = self.follower
        return {
            "replica_id": self.replica_id,
            "epoch": f.epoch,
            "end_offset": f.files.end_offset,
            "applied_commits": f.applied_commits,
            "applied_bytes": f.applied_bytes,
            "silent_for": f.silent_for(),
        }

    # -- the leader ----------------------------------------------------------------------

    def apply(self, epoch: int, write: MirrorWrite) -> None:
        """One commit of the leader of ``epoch``, written durably."""
        self.follower.apply(epoch, write)

    def heartbeat(self, epoch: int) -> None:
        """The leader of ``epoch`` lives."""
        self.follower.heartbeat(epoch)

    def state(self, epoch: int) -> MirrorState:
        """What this copy holds."""
        return self.follower.state(epoch)

    def truncate_to(self, epoch: int, offset: int) -> MirrorState:
        """Cut this copy back to the records before ``offset``."""
        return self.follower.truncate_to(epoch, offset)

    def write_chunk(self, epoch: int, name: str, pos: int, data: np.ndarray, sync: bool) -> None:
        """Copy bytes of one of the leader's segment files."""
        self.follower.write_chunk(epoch, name, pos, data, sync)

    def install(
        self,
        epoch: int,
        segments: dict[str, int],
        small_files: dict[str, bytes],
        epochs: list[tuple[int, int]],
        end_offset: int,
        seq: int,
    ) -> None:
        """Finish catching up: in sync from the leader's commit after ``seq``."""
        self.follower.install(epoch, segments, small_files, epochs, end_offset, seq)


class RayFollowerLink:
    """A leader's ``FollowerLink`` to a ReplicaActor: commits and heartbeats over the
    follower's ReplicaChannel (a socket; through Ray calls if it has none), catching up
    through Ray calls. A commit leaves at once when the channel is connected."""

    def __init__(self, replica_id: str, node_id: str, handle):
        self.replica_id, self.node_id, self.handle = replica_id, node_id, handle
        self._channel: ReplicaChannel | None = None
        self._no_channel = False  # the follower has none: Ray calls

    def apply(self, epoch: int, write: MirrorWrite):
        """See ``FollowerLink``."""
        if self._channel is not None:
            return self._guarded(self._channel.apply(epoch, write))
        return self._first(lambda ch: ch.apply(epoch, write), "apply", epoch, write)

    def heartbeat(self, epoch: int):
        """See ``FollowerLink``."""
        if self._channel is not None:
            return self._guarded(self._channel.heartbeat(epoch))
        return self._first(lambda ch: ch.heartbeat(epoch), "heartbeat", epoch)

    async def _guarded(self, answer) -> None:
        try:
            await answer
        except (TimeoutError, WireBroken, asyncio.CancelledError):
            # Failed, or given up on: found again next time (the follower may have
            # restarted), never left half-connected.
            self._drop_channel()
            raise

    def _drop_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None

    async def _first(self, send, method: str, epoch: int, write: MirrorWrite | None = None):
        if not self._no_channel:
            endpoint = await self.handle.endpoint.remote()
            if endpoint is not None:
                if self._channel is None:
                    self._channel = ReplicaChannel(*endpoint, replica=self.replica_id)
                return await self._guarded(send(self._channel))
            self._no_channel = True
        if write is None:
            return await self.handle.heartbeat.remote(epoch)
        return await self.handle.apply.remote(epoch, write.portable())

    def state(self, epoch: int):
        """See ``FollowerLink``."""
        return self.handle.state.remote(epoch)

    def truncate_to(self, epoch: int, offset: int):
        """See ``FollowerLink``."""
        return self.handle.truncate_to.remote(epoch, offset)

    def write_chunk(self, epoch: int, name: str, pos: int, data: np.ndarray, sync: bool):
        """See ``FollowerLink``."""
        return self.handle.write_chunk.remote(epoch, name, pos, data, sync)

    def install(self, epoch, segments, small_files, epochs, end_offset, seq):
        """See ``FollowerLink``."""
        return self.handle.install.remote(epoch, segments, small_files, epochs, end_offset, seq)

    def close(self) -> None:
        """Drop the channel."""
        self._drop_channel()

    def same_as(self, other) -> bool:
        """``other`` reaches the same follower actor."""
        theirs = getattr(other, "handle", None)
        if theirs is None:
            return False
        return getattr(self.handle, "_actor_id", self.handle) == getattr(
            theirs, "_actor_id", theirs
        )


@dataclass(frozen=True)
class LeaderRole:
    """What the controller tells a queue actor that leads a replicated queue."""

    replica_id: str
    #: Its copy of the queue's files.
    directory: str
    epoch: int
    #: (replica id, node id, ReplicaActor handle) of each follower.
    followers: tuple = ()

    def links(self) -> list[RayFollowerLink]:
        """The leader's links to its followers."""
        return [RayFollowerLink(rid, node, handle) for rid, node, handle in self.followers]
