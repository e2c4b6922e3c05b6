"""Replica copies left behind: recorded, reported, removed.

A replicated queue's replica holds a full copy of the queue's files on its node, in
``<paging_directory>/<queue>/<replica id>``. The replication controller gives a copy up
when its replica leaves the set while the files cannot be deleted: a replaced leader
whose node was lost or that did not rejoin in time (``REJOIN_SECONDS``), a lost
follower replaced by another. Such a copy used to stay on its node, unreported, taking
its disk space. Now each is a ``Leftover``, saved with the broker's state in
``<paging_directory>/.leftovers.json`` (docs/FORMAT.md, "Replicas"), shown by ``raymq
status`` and removed by ``raymq remove-leftovers`` on its node
(``remove_replica_copy``), never while a replica of that id runs there.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass

from raymq.errors import StorageError
from raymq.storage import write_file_atomic
from raymq.storage.files import fsync_directory, storage_error
from raymq.storage.lock import DirectoryLock

#: The file, in the broker's paging directory, listing the copies left behind.
LEFTOVERS_NAME = ".leftovers.json"
#: What may be done with a copy left behind (``ReplicationController.leftover_verdicts``):
REMOVABLE = "remove"
IN_THE_SET = "in the replica set again"  # on that node: its record is stale
RUNNING = "a replica of that id runs"  # rejoining: kept until it is decided
NODE_GONE = "node not alive"  # kept: removed if the node comes back


@dataclass(frozen=True)
class Leftover:
    """One replica's copy given up on its node."""

    queue: str
    replica_id: str
    node_id: str
    #: Why it was given up (for ``raymq status``).
    why: str
    #: When (seconds since the epoch).
    since: float

    @property
    def key(self) -> tuple[str, str, str]:
        """(queue, replica id, node id): one copy."""
        return (self.queue, self.replica_id, self.node_id)


class Leftovers:
    """The copies left behind, kept in ``<paging_directory>/.leftovers.json``."""

    def __init__(self, paging_directory: str | None):
        """``paging_directory`` None: kept in memory only (tests)."""
        self.path = (
            None if paging_directory is None else os.path.join(paging_directory, LEFTOVERS_NAME)
        )
        self._by_key: dict[tuple[str, str, str], Leftover] = {}
        if self.path is not None and os.path.exists(self.path):
            with open(self.path) as f:
                for item in json.load(f):
                    left = Leftover(**item)
                    self._by_key[left.key] = left

    def __iter__(self):
        return iter(sorted(self._by_key.values(), key=lambda x: (x.queue, x.replica_id)))

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, queue: str, replica_id: str, node_id: str, why: str) -> Leftover:
        """Record a copy given up (again: its reason is updated); saved at once."""
        left = Leftover(queue, replica_id, node_id, why, time.time())
        self._by_key[left.key] = left
        self._save()
        return left

    def drop(self, queue: str, replica_id: str, node_id: str) -> bool:
        """Forget a copy (removed, or in use again); saved at once. False if unknown."""
        if self._by_key.pop((queue, replica_id, node_id), None) is None:
            return False
        self._save()
        return True

    def _save(self) -> None:
        if self.path is None:
            return
        data = json.dumps([asdict(x) for x in self], indent=1).encode()
        write_file_atomic(self.path, data)


def verdict(in_the_set: bool, running: bool, node_alive: bool) -> str:
    """What ``raymq remove-leftovers`` may do with a copy left behind: its replica is in
    the set again on that node, runs there (rejoining), its node is not alive, or none
    of these (``REMOVABLE``)."""
    if in_the_set:
        return IN_THE_SET
    if running:
        return RUNNING
    return REMOVABLE if node_alive else NODE_GONE


def replica_copy_path(paging_directory: str, queue: str, replica_id: str) -> str:
    """Where replica ``replica_id`` of ``queue`` keeps its copy on its node."""
    return os.path.join(paging_directory, queue, replica_id)


def remove_replica_copy(paging_directory: str, queue: str, replica_id: str) -> str:
    """Remove one replica's copy on this node: "removed", or "absent" when there is
    none. ``StorageError`` (naming the directory) if a queue process holds its lock
    (a leader runs on it) or it cannot be removed. The queue's directory goes too when
    nothing else is left in it."""
    path = replica_copy_path(paging_directory, queue, replica_id)
    parent = os.path.dirname(path)
    if os.path.realpath(os.path.dirname(parent)) != os.path.realpath(paging_directory):
        raise StorageError(errno.EINVAL, f"queue {queue!r}: {path} is not a replica's copy", path)
    if not os.path.isdir(path):
        return "absent"
    lock = DirectoryLock.acquire(path, queue, wait_seconds=0.0)  # StorageError if held
    try:
        shutil.rmtree(path)
    except OSError as exc:
        raise storage_error(queue, f"removing the copy {path}", path, exc) from exc
    finally:
        lock.release()
    with contextlib.suppress(OSError):
        os.rmdir(parent)  # only if empty (another copy, or queue.json, keeps it)
    with contextlib.suppress(OSError):  # the names' removal made durable, best effort
        fsync_directory(parent if os.path.isdir(parent) else paging_directory)
    return "removed"
