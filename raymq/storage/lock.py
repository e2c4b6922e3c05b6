"""The QueueArea's ``LOCK`` file: one process at a time owns a queue directory.

Why: Ray reports a killed actor dead before its process has gone. A new actor for the
same queue, started at once (by the broker's supervisor, or a revival), would otherwise
recover and write the same files while the old process still answers its send channel:
two writers of one log. LevelDB guards its directory the same way.

A POSIX record lock (``fcntl.lockf``) is used rather than ``flock``: it belongs to the
process, so a process may open the directory again after abandoning a log without
closing it (what the crash tests do), and the kernel drops it when the process dies,
however it dies.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable

from raymq.errors import StorageError
from raymq.storage.files import storage_error
from raymq.storage.format import FILE_MODE

log = logging.getLogger("raymq.storage")

#: The lock file's name inside a queue directory.
LOCK_NAME = "LOCK"
#: How long opening a queue directory waits for another process to let it go (seconds):
#: a killed actor's process takes a moment to end.
LOCK_WAIT_SECONDS = 30.0
#: Pause between two attempts while another process holds the lock (seconds).
LOCK_POLL_SECONDS = 0.02


class DirectoryLock:
    """An exclusive lock on one queue directory, held from ``acquire`` to ``release``."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(
        cls,
        directory: str,
        queue: str,
        *,
        wait_seconds: float = LOCK_WAIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> DirectoryLock:
        """Lock ``directory`` for this process, waiting up to ``wait_seconds`` while
        another process holds it (logged); ``StorageError`` naming the queue, the lock
        file and the holder's pid after that."""
        path = os.path.join(directory, LOCK_NAME)
        fd = _open_lock_file(path, queue)
        try:
            waited = _lock_or_wait(fd, path, queue, wait_seconds, clock, sleep)
            # Who holds it, for the message above in the next process (not fsynced:
            # a hint, not state).
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        if waited:
            log.warning("queue %r: %s acquired after waiting", queue, path)
        return cls(fd, path)

    def release(self) -> None:
        """Let the directory go (closing the file drops the lock); idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _open_lock_file(path: str, queue: str) -> int:
    """The lock file at ``path`` opened read-write (created if needed) with mode 0600;
    ``StorageError`` naming ``queue`` and the file if that fails."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as exc:
        raise storage_error(queue, "opening the directory lock", path, exc) from exc
    try:
        os.fchmod(fd, FILE_MODE)  # 0600 whatever the umask, as every file here
    except OSError as exc:
        os.close(fd)
        raise storage_error(queue, "opening the directory lock", path, exc) from exc
    return fd


def _lock_or_wait(
    fd: int,
    path: str,
    queue: str,
    wait_seconds: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> bool:
    """Take the lock on ``fd``, polling every ``LOCK_POLL_SECONDS`` for up to
    ``wait_seconds`` (seconds of ``clock``) while another process holds it; returns
    whether it had to wait (logged when the wait starts). ``StorageError`` when the
    time is up or locking fails otherwise; ``fd`` stays open either way."""
    deadline = clock() + wait_seconds
    waited = False
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return waited
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise storage_error(queue, "locking the directory", path, exc) from exc
        if not waited:
            waited = True
            log.warning(
                "queue %r: %s is held by process %s; waiting up to %.0f s for it",
                queue,
                path,
                _holder(fd),
                wait_seconds,
            )
        if clock() >= deadline:
            err = StorageError(
                errno.EWOULDBLOCK,
                f"queue {queue!r}: another process ({_holder(fd)}) still has the"
                f" queue directory open after {wait_seconds:.0f} s; two may not"
                " write one queue",
                path,
            )
            err.queue = queue
            raise err
        sleep(LOCK_POLL_SECONDS)


def _holder(fd: int) -> str:
    """What the lock file says of its holder: "pid N", or "pid unknown"."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "pid unknown"
