"""The replica protocol: a leader's commits to a follower over the wire.

A replicated commit waits for its followers, so their round trip is on every send's
path. A Ray actor call costs 1-2 ms here and about 0.7 ms of CPU at each end, and a
commit of 2 MiB as a Ray argument goes through the object store and is copied between
nodes (``bench/replication.py`` measured both: 0.22x of an unreplicated queue). So each
follower serves this protocol (docs/WIRE.md "replica") and its leader keeps one
connection to it for commits and heartbeats. Catching up (rare, large) stays on Ray.

Ops:

- ``apply [epoch, seq, end_offset, records, checkpoint, deleted, has_ack]`` where
  ``records`` is ``[[file name, position, length, pieces], ...]`` and ``checkpoint`` nil or
  ``[generation, next offset, length]``, with raw buffers: the ack record (if
  ``has_ack``), each record's pieces and the checkpoint's, in that order (``MirrorWrite``,
  docs/FORMAT.md "Replicas"). A commit's bytes are received straight into one buffer and
  written to the files from it: no copy between the socket and the disk.
- ``heartbeat [epoch]``: the leader of ``epoch`` lives.

Both are answered true, ``["Fenced", epoch]`` or ``["Diverged", message]``; a follower's
other failure (a disk error, say) is an error answer, and the leader takes that follower
out of sync (``WireBroken``), as when the connection fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from raymq.core.replication import Fenced
from raymq.storage.mirror import Diverged, MirrorWrite
from raymq.wire.client import WireClient
from raymq.wire.errors import WireBroken
from raymq.wire.frames import Buffer
from raymq.wire.server import Op, Protocol, ProtocolServer, Request, WireServer

log = logging.getLogger("raymq.wire.replica")

PROTOCOL = "replica"
#: Longest request header (bytes); the raw buffers after it are bounded separately.
REQUEST_LIMIT = 16 * 2**20
#: Longest raw buffers of one commit (bytes).
PAYLOAD_LIMIT = 2**31
#: Seconds a client waits to connect and for the hello's answer, in all: less than a
#: commit waits for a follower (``FOLLOWER_TIMEOUT_SECONDS``).
CONNECT_TIMEOUT_SECONDS = 2.0
#: Raw buffers one commit may carry (its records' pieces).
MAX_BUFFERS = 1 << 20


class ReplicaServer(ProtocolServer):
    """Serves a leader's commits and heartbeats to one follower. ``follower`` has the
    methods of ``raymq.core.replication.ReplicationFollower`` (``apply``,
    ``heartbeat``)."""

    def __init__(self, follower, queue: str):
        self._follower = follower
        protocol = Protocol(
            PROTOCOL,
            {
                "apply": Op(self._apply, _check_apply, max_buffers=MAX_BUFFERS),
                "heartbeat": Op(self._heartbeat, _check_heartbeat),
            },
            request_limit=REQUEST_LIMIT,
            payload_limit=PAYLOAD_LIMIT,
        )
        self.server = WireServer(protocol, f"replica of queue {queue!r}")

    def close(self) -> None:
        """Stop listening and drop the open connections (a released follower takes no
        more commits)."""
        self.server.close(grace=0.0)

    def _apply(self, request: Request) -> object:
        write = _mirror_write(request.args, request.buffers)
        return _outcome(self._follower.apply, write.epoch, write)

    def _heartbeat(self, request: Request) -> object:
        return _outcome(self._follower.heartbeat, request.args[0])


def _outcome(method: Callable, *args) -> object:
    """True, or the fencing or divergence the follower raised, as an answer; its other
    errors are the request's error answer."""
    try:
        method(*args)
        return True
    except Fenced as exc:
        return ["Fenced", exc.epoch]
    except Diverged as exc:
        return ["Diverged", str(exc)]


def _check_apply(args: list, buffers: list) -> None:
    if len(args) != 7 or type(args[6]) is not bool:
        raise ValueError("apply takes [epoch, seq, end, records, checkpoint, deleted, has_ack]")
    records, checkpoint = args[3], args[4]
    if type(records) is not list or not all(
        type(r) is list and len(r) == 4 and type(r[3]) is int and r[3] >= 0 for r in records
    ):
        raise ValueError("apply: records are [[file name, position, length, pieces], ...]")
    wanted = int(args[6]) + sum(r[3] for r in records) + (checkpoint is not None)
    if len(buffers) != wanted:
        raise ValueError(f"apply: {len(buffers)} raw buffers for {wanted} parts")


def _check_heartbeat(args: list, buffers: list) -> None:
    if len(args) != 1 or type(args[0]) is not int:
        raise ValueError("heartbeat takes [epoch]")


def _mirror_write(args: list, buffers: list) -> MirrorWrite:
    """The ``MirrorWrite`` a commit request and its raw buffers carry (views into them)."""
    epoch, seq, end_offset, records, checkpoint, deleted, has_ack = args
    write = MirrorWrite(epoch=epoch, seq=seq, end_offset=end_offset, deleted=list(deleted))
    parts = iter(buffers)
    if has_ack:
        write.ack_record = bytes(next(parts))
    for name, at, length, pieces in records:
        data = [next(parts) for _ in range(pieces)]
        if sum(memoryview(b).nbytes for b in data) != length:
            raise ValueError(f"apply: record of {name!r} is not {length} bytes")
        write.records.append((name, at, data))
    if checkpoint is not None:
        gen, next_offset, _length = checkpoint
        write.checkpoint = (gen, next_offset, bytes(next(parts)))
    return write


class ReplicaChannel:
    """The leader's connection to one follower, on the leader's event loop. A request is
    written as it is made (``apply`` returns an awaitable of the answer), so that it
    travels while the leader writes its own copy. Connects on first use, and again after
    a failure."""

    def __init__(self, host: str, port: int, secret: str, replica: str):
        self._endpoint = (host, port, secret)
        self._replica = replica
        self._client: WireClient | None = None
        self._connecting: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        """True while the connection is up."""
        return self._client is not None and self._client.broken is None

    async def connect(self) -> None:
        """Connect and say hello (``WireBroken`` if that fails). Concurrent callers
        share one attempt; whatever ends it, the next request starts a new one."""
        if self.connected:
            return
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(
                WireClient.connect(
                    self._endpoint,
                    PROTOCOL,
                    f"replica {self._replica}",
                    timeout=CONNECT_TIMEOUT_SECONDS,
                )
            )
        connecting = self._connecting
        try:
            self._client = await asyncio.shield(connecting)
        finally:
            if connecting.done():
                if self._connecting is connecting:
                    self._connecting = None
                if not connecting.cancelled():
                    connecting.exception()  # (retrieved: raised to its awaiters)

    def _send(self, op: str, args: list, buffers: Sequence[Buffer]) -> Awaitable[None]:
        if not self.connected:
            return self._connect_then_send(op, args, buffers)
        assert self._client is not None
        return _outcome_of(self._client.request(op, args, buffers))

    async def _connect_then_send(self, op: str, args: list, buffers: Sequence[Buffer]) -> None:
        await self.connect()
        await self._send(op, args, buffers)

    def apply(self, epoch: int, write: MirrorWrite) -> Awaitable[None]:
        """Send one commit now; the awaitable ends once the follower has it durably."""
        buffers: list[Buffer] = []
        if write.ack_record is not None:
            buffers.append(write.ack_record)
        records = []
        for name, pos, bufs in write.records:
            records.append([name, pos, sum(memoryview(b).nbytes for b in bufs), len(bufs)])
            buffers += bufs
        checkpoint = None
        if write.checkpoint is not None:
            gen, next_offset, data = write.checkpoint
            checkpoint = [gen, next_offset, len(data)]
            buffers.append(data)
        args = [
            epoch,
            write.seq,
            write.end_offset,
            records,
            checkpoint,
            write.deleted,
            write.ack_record is not None,
        ]
        return self._send("apply", args, buffers)

    def heartbeat(self, epoch: int) -> Awaitable[None]:
        """Tell the follower the leader of ``epoch`` lives."""
        return self._send("heartbeat", [epoch], ())

    def close(self) -> None:
        """Drop the connection: requests waiting fail (``WireBroken``), and the next
        request connects again."""
        if self._client is not None:
            self._client.close()
        self._client = None


async def _outcome_of(fut: asyncio.Future) -> None:
    """Raise what the follower answered: ``Fenced``, ``Diverged``, or ``WireBroken`` for
    its other errors (the leader takes it out of sync)."""
    try:
        answer = (await fut).value
    except WireBroken:
        raise
    except Exception as exc:  # the follower's error (a disk error, say)
        raise WireBroken(f"the follower failed: {exc!r}") from exc
    if answer is True:
        return
    if isinstance(answer, list) and len(answer) == 2:
        kind, detail = answer
        if kind == "Fenced":
            raise Fenced(int(detail))
        if kind == "Diverged":
            raise Diverged(str(detail))
    raise WireBroken(f"a bad answer: {answer!r:.100}")
