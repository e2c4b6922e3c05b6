"""How a task's status is read: from the result store's file when this process is on
the store's node, else by a call to its actor.

A status is what users poll (``get_task_status_sync`` in a loop, as with Celery, whose
statuses are Redis GETs). Through the actor each poll is a Ray call into the process
that also commits every task's start and finish; read from the file beside it (SQLite
in WAL mode: every committed batch seen, no wait for a commit under way) it costs a
SQLite read in the caller. Where the store is is asked again every
``RECHECK_SECONDS``, so that a store that moved (its broker restarted on another
node) is followed within that time; a file that cannot be read, or is not the store's
(its id differs), sends the reads to the actor until the next check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from raymq.core.tasks import StoreLocation, TaskRecord
from raymq.errors import StorageError
from raymq.storage.task_results import TaskResultsReader

log = logging.getLogger("raymq.serve")

#: Seconds between two askings of where the store is.
RECHECK_SECONDS = 5.0


class NotLocal:
    """``StatusReads.get``'s answer when the read must go to the actor."""


NOT_LOCAL = NotLocal()


class StatusReads:
    """Task records read from the store's file on its node (see the module).

    ``locate`` asks the store where it is (a call to its actor: its errors are the
    actor's, and send the read there too); ``node_id`` is this process's node;
    ``clock`` gives seconds (monotonic)."""

    def __init__(
        self,
        locate: Callable[[], StoreLocation],
        node_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        open_reader: Callable[[str, str], TaskResultsReader] = TaskResultsReader,
    ):
        self._locate = locate
        self._node_id = node_id
        self._clock = clock
        self._open = open_reader
        self._lock = threading.Lock()
        self._reader: TaskResultsReader | None = None
        self._where: StoreLocation | None = None
        self._next_check = 0.0
        self.local_reads = 0  # records read from the file
        self.failures = 0  # files that could not be opened or read

    def get(self, task_id: str) -> TaskRecord | None | NotLocal:
        """The task's record (None: it has none) read from the file, or ``NOT_LOCAL``."""
        reader = self._current()
        if reader is None:
            return NOT_LOCAL
        try:
            record = reader.get(task_id)
        except StorageError as exc:
            self._failed(reader, exc)
            return NOT_LOCAL
        self.local_reads += 1
        return record

    def close(self) -> None:
        """Close the file (reads go to the actor until the next check)."""
        with self._lock:
            self._drop()

    def _current(self) -> TaskResultsReader | None:
        with self._lock:
            now = self._clock()
            if now < self._next_check:
                return self._reader
            self._next_check = now + RECHECK_SECONDS
            try:
                where = self._locate()
            except Exception as exc:  # noqa: BLE001 - the actor's: the read goes there
                log.info("task results: where the store is not known: %r", exc)
                self._drop()
                return None
            if where.node_id != self._node_id:
                self._drop()  # on another node: its file is not this one's
                return None
            if self._reader is not None and where == self._where:
                return self._reader
            self._drop()
            try:
                self._reader = self._open(where.path, where.store_id)
            except StorageError as exc:
                self.failures += 1
                log.warning("task results: reading by the actor: %s", exc)
                return None
            self._where = where
            return self._reader

    def _failed(self, reader: TaskResultsReader, exc: StorageError) -> None:
        self.failures += 1
        log.warning("task results: reading by the actor: %s", exc)
        with self._lock:
            if self._reader is reader:
                self._drop()

    def _drop(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader, self._where = None, None
