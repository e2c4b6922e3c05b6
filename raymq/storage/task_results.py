"""TaskResults: the durable store of task statuses and results, one SQLite file.

Ray Serve's task consumers (``raymq.serve``) record here what became of each task, so
that ``get_task_status_sync`` answers after replicas, the broker or the whole cluster
restarted. A task gets its record when it starts (or is cancelled): a waiting task is
its queue's message only, so that enqueuing writes nothing here. The rows live on disk
(SQLite's page cache is all it holds in memory); ``apply`` commits a batch of calls with
``synchronous=FULL`` in WAL mode, on disk before it returns, one fsync for the batch;
rows of ended tasks are deleted ``result_ttl_s`` after their last change (``expire``;
each task has its own TTL). SQLite ships with Python: no server beside Ray, no
dependency.

Results and arguments are msgpack values. A damaged file raises ``StorageError``
naming it; it is never silently replaced (results would be lost without a word).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from raymq.core.tasks import (
    CANCELLED,
    FINAL,
    PENDING,
    STARTED,
    STATUSES,
    TaskRecord,
    pack_result,
)
from raymq.errors import StorageError

#: The store's directory in the broker's paging directory: a name no queue can have (a
#: queue's may not start with ".").
TASKS_DIRECTORY = ".tasks"
#: The store's file in it (SQLite adds ``-wal`` and ``-shm`` beside it).
FILE_NAME = "task-results.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    runs INTEGER NOT NULL,
    ttl REAL NOT NULL,
    result BLOB,
    error_type TEXT,
    error TEXT,
    traceback TEXT
);
CREATE INDEX IF NOT EXISTS tasks_by_expiry ON tasks (updated_at + ttl);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
#: What ``apply`` runs.
_OPERATIONS = frozenset({"start", "finish", "cancel", "expire", "get", "counts"})
_COLUMNS = "id, status, name, created_at, updated_at, runs, result, error_type, error, traceback"
_GET = f"SELECT {_COLUMNS} FROM tasks WHERE id = ?"


class TaskResults:
    """The statuses and results of a broker's tasks, in ``directory``/``FILE_NAME``
    (the broker's is ``<paging_directory>/.tasks``).

    Not thread-safe: its owner (``TaskResultsActor``) calls it one call at a time."""

    def __init__(self, directory: str, clock: Callable[[], float] = time.time):
        self.path = os.path.join(directory, FILE_NAME)
        self._clock = clock
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # (whatever the umask, as every RayMQ directory)
        # Made 0600 before SQLite opens it: its -wal and -shm files take its mode.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            self._db.execute("PRAGMA quick_check").fetchall()
            # Names this file for readers (TaskResultsReader): a file of the same path
            # on another node, or made again after this one was removed, is another.
            self._db.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('store_id', ?)",
                (uuid.uuid4().hex,),
            )
            self.store_id: str = _store_id(self._db) or ""
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"task results {self.path}: {exc}") from exc

    def close(self) -> None:
        """Close the file (every write is on disk already)."""
        self._db.close()

    # -- operations --------------------------------------------------------------------

    def apply(self, calls: list[tuple[str, tuple]]) -> list[Any]:
        """Run ``calls`` (method name, arguments) of this class in one transaction: one
        fsync for them all (the owner gathers concurrent callers' calls). Each call's
        value is in the list, or the exception it raised (it wrote nothing then);
        ``StorageError`` for the file fails them all."""
        out: list[Any] = []
        with self._transaction():
            for name, args in calls:
                if name not in _OPERATIONS:
                    out.append(ValueError(f"task results: no operation {name!r}"))
                    continue
                try:
                    out.append(getattr(self, name)(*args))
                except StorageError:
                    raise
                except Exception as exc:  # noqa: BLE001 - that call's answer
                    out.append(exc)
        return out

    def start(self, task_id: str, name: str, ttl_seconds: float) -> TaskRecord:
        """A handler is about to run the task: STARTED, one more run counted, unless it
        ended already (CANCELLED, or run to its end before a redelivery): then the
        record is returned unchanged and the task must not run. Its record is kept
        ``ttl_seconds`` after it ends."""
        record = self._get(task_id)
        if record is not None and record.status in FINAL:
            return record
        now = self._clock()
        self._write(
            "INSERT INTO tasks (id, status, name, created_at, updated_at, runs, ttl)"
            " VALUES (?, ?, ?, ?, ?, 1, ?) ON CONFLICT (id) DO UPDATE SET"
            " status = excluded.status, updated_at = excluded.updated_at, runs = runs + 1",
            (task_id, STARTED, name, now, now, ttl_seconds),
        )
        started = self._get(task_id)
        assert started is not None
        return started

    def finish(
        self,
        task_id: str,
        name: str,
        ttl_seconds: float,
        status: str,
        result: Any = None,
        error_type: str | None = None,
        error: str | None = None,
        traceback: str | None = None,
    ) -> None:
        """The task ended with ``status`` (SUCCESS with ``result``, FAILURE with the
        exception's type, text and traceback; a task that never started too, an
        unknown one say). ``TypeError`` if ``result`` is not a msgpack value, and
        ``ValueError`` for a status that is not final (nothing is written then)."""
        if status not in FINAL:
            raise ValueError(f"finish: {status!r} is not a final status")
        blob = pack_result(task_id, result)
        now = self._clock()
        self._write(
            "INSERT INTO tasks (id, status, name, created_at, updated_at, runs, ttl, result,"
            " error_type, error, traceback) VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET status = excluded.status,"
            " updated_at = excluded.updated_at, result = excluded.result,"
            " error_type = excluded.error_type, error = excluded.error,"
            " traceback = excluded.traceback",
            (task_id, status, name, now, now, ttl_seconds, blob, error_type, error, traceback),
        )

    def cancel(self, task_id: str, ttl_seconds: float) -> bool:
        """Cancel a task that has not started: when its message comes, it is not run.
        False if it has started or ended. (A task with no record has not started:
        nothing is written when one is enqueued, a send's only write.)"""
        now = self._clock()
        cur = self._write(
            "INSERT OR IGNORE INTO tasks (id, status, name, created_at, updated_at, runs, ttl)"
            " VALUES (?, ?, '', ?, ?, 0, ?)",
            (task_id, CANCELLED, now, now, ttl_seconds),
        )
        return cur.rowcount == 1

    def expire(self) -> int:
        """Delete the ended tasks whose TTL passed since their last change; returns how
        many."""
        marks = ",".join("?" * len(FINAL))
        cur = self._write(
            f"DELETE FROM tasks WHERE updated_at + ttl < ? AND status IN ({marks})",
            (self._clock(), *sorted(FINAL)),
        )
        return cur.rowcount

    def get(self, task_id: str) -> TaskRecord | None:
        """The task's record; None if it has none (not started yet, or expired)."""
        return self._get(task_id)

    def counts(self) -> dict[str, int]:
        """Tasks recorded, by status (every status but PENDING, 0 if none: a task
        waiting in its queue has no record)."""
        rows = self._read("SELECT status, COUNT(*) FROM tasks GROUP BY status", ())
        found = dict(rows.fetchall())
        return {status: int(found.get(status, 0)) for status in sorted(STATUSES - {PENDING})}

    # -- internals --------------------------------------------------------------------

    def _get(self, task_id: str) -> TaskRecord | None:
        return _record_of(self._read(_GET, (task_id,)).fetchone())

    def _write(self, sql: str, params: tuple) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, params)
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"task results {self.path}: {exc}") from exc

    _read = _write

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on an error)."""
        self._write("BEGIN IMMEDIATE", ())
        try:
            yield
        except BaseException:
            self._write("ROLLBACK", ())
            raise
        self._write("COMMIT", ())


class TaskResultsReader:
    """Reads task records straight from the store's file, beside its writer: a status
    asked on the store's node costs a SQLite read, not a call to the actor (WAL: it
    sees every committed batch, and never waits for a commit under way).

    Opened read-only, and only on the file whose ``store_id`` is the one given (the
    writer's ``TaskResults.store_id``); ``StorageError`` naming the file otherwise, or
    when a read fails. Thread-safe (one connection under a lock)."""

    def __init__(self, path: str, store_id: str):
        self.path = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(
                f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
            )
            found = _store_id(self._db)
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"task results {path}: {exc}") from exc
        if found != store_id:
            self._db.close()
            raise StorageError(f"task results {path}: store {found!r}, not {store_id!r}")

    def get(self, task_id: str) -> TaskRecord | None:
        """The task's record; None if it has none (see ``TaskResults.get``)."""
        try:
            with self._lock:
                row = self._db.execute(_GET, (task_id,)).fetchone()
            return _record_of(row)
        # Every error of the module (a connection another thread closed, as StatusReads
        # drops a reader that failed, raises ProgrammingError: a DatabaseError too).
        except (sqlite3.Error, ValueError, msgpack.UnpackException) as exc:
            raise StorageError(f"task results {self.path}: task {task_id}: {exc!r}") from exc

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()


def _store_id(db: sqlite3.Connection) -> str | None:
    row = db.execute("SELECT value FROM meta WHERE key = 'store_id'").fetchone()
    return None if row is None else row[0]


def _record_of(row: tuple | None) -> TaskRecord | None:
    if row is None:
        return None
    task_id, status, name, created, updated, runs, blob, error_type, error, tb = row
    result = None if blob is None else msgpack.unpackb(blob, raw=False, strict_map_key=False)
    return TaskRecord(task_id, status, name, created, updated, runs, result, error_type, error, tb)
