"""QueueRegistry: which queues a broker has, with their settings and node, on disk.

Each queue directory under the paging directory holds a ``queue.json``
(``{"config": {...}, "node_id": "..."}``, docs/FORMAT.md), written atomically and
durably. The broker actor keeps no other state: after a restart it reads the registry
again from these files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from raymq.config import QueueConfig
from raymq.core.controller import ReplicaSet
from raymq.storage import create_queue_directory, write_file_atomic
from raymq.storage.format import QUEUE_CONFIG_NAME


@dataclass(frozen=True)
class QueueEntry:
    """A queue's settings and the Ray node id holding its files ("" if unknown); for
    a replicated queue, its replicas (``node_id`` is then the leader's node)."""

    config: QueueConfig
    node_id: str
    replicas: ReplicaSet | None = None


class QueueRegistry:
    """The ``queue.json`` files of one paging directory."""

    def __init__(self, paging_directory: str):
        self.paging_directory = paging_directory

    def directory(self, name: str) -> str:
        """The queue's directory."""
        return os.path.join(self.paging_directory, name)

    def replica_directory(self, name: str, replica_id: str) -> str:
        """The directory of one replica's copy of a replicated queue (on its node)."""
        return os.path.join(self.paging_directory, name, replica_id)

    def has_files(self, name: str) -> bool:
        """True if the queue's ``queue.json`` is in this paging directory."""
        return os.path.isfile(os.path.join(self.directory(name), QUEUE_CONFIG_NAME))

    def load(self) -> dict[str, QueueEntry]:
        """Every queue whose ``queue.json`` is here, by name (the paging directory is
        created if missing)."""
        os.makedirs(self.paging_directory, exist_ok=True)
        found: dict[str, QueueEntry] = {}
        for name in sorted(os.listdir(self.paging_directory)):
            if not self.has_files(name):
                continue
            with open(os.path.join(self.directory(name), QUEUE_CONFIG_NAME)) as f:
                saved = json.load(f)
            replicas = saved.get("replication")
            found[name] = QueueEntry(
                QueueConfig(**saved["config"]),
                saved.get("node_id", ""),
                ReplicaSet.from_dict(replicas) if replicas else None,
            )
        return found

    def save(self, entry: QueueEntry) -> None:
        """Create the queue's directory (0700, durable) if needed and write its
        ``queue.json`` atomically and durably."""
        directory = self.directory(entry.config.name)
        create_queue_directory(directory)
        saved = {"config": entry.config.to_dict(), "node_id": entry.node_id}
        if entry.replicas is not None:
            saved["replication"] = entry.replicas.to_dict()
        write_file_atomic(os.path.join(directory, QUEUE_CONFIG_NAME), json.dumps(saved).encode())


__all__ = ["QueueEntry", "QueueRegistry"]
