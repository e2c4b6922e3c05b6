"""File helpers of the storage engine: private modes, durable creation, vectored writes,
space reservation and typed errors.

Everything the storage creates is 0600 (files) or 0700 (directories) whatever the
umask: message bodies are nobody else's business.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os

from raymq.errors import StorageError
from raymq.storage.format import DIRECTORY_MODE, FILE_MODE

#: Buffers per pwritev call (Linux's IOV_MAX is 1024).
IOV_MAX = 1020
#: Linux fallocate(2) flag: allocate blocks without changing the file's size.
_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2


def storage_error(queue: str, action: str, path: str, exc: OSError) -> StorageError:
    """A ``StorageError`` naming the queue, the file and the errno of ``exc``."""
    code = exc.errno if exc.errno is not None else errno.EIO
    reason = exc.strerror or str(exc)
    err = StorageError(code, f"queue {queue!r}: {action} failed: {reason}", path)
    err.queue = queue
    return err


def create_file(path: str, *, exclusive: bool = True, append: bool = False) -> int:
    """Open a new file 0600 (whatever the umask) for reading and writing; returns its fd."""
    flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    if append:
        flags |= os.O_APPEND
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return fd


def make_directory(path: str) -> bool:
    """Create ``path`` 0700 (whatever the umask) if missing; True if it was created.
    An existing directory is left as it is."""
    try:
        os.mkdir(path, DIRECTORY_MODE)
    except FileExistsError:
        return False
    os.chmod(path, DIRECTORY_MODE)
    return True


def create_queue_directory(directory: str) -> None:
    """Create a queue's directory durably: 0700, and its parent (the paging directory)
    fsynced so that the new entry survives a crash. Idempotent; an existing queue
    directory is made 0700 (it holds only RayMQ's files). The paging directory is
    created 0700 if missing (an existing one keeps its mode)."""
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(parent):
        os.makedirs(parent, DIRECTORY_MODE, exist_ok=True)
        os.chmod(parent, DIRECTORY_MODE)
        fsync_directory(os.path.dirname(parent))
    if make_directory(directory):
        fsync_directory(parent)
    else:
        os.chmod(directory, DIRECTORY_MODE)


def remove_file(path: str) -> OSError | None:
    """Unlink ``path`` (already gone is fine); the ``OSError`` if it could not be
    removed, for the caller to log and try again: a file left behind is never fatal."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc
    return None


def write_synced(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` (created or truncated, 0600) and fsync it."""
    fd = create_file(path, exclusive=False)
    try:
        pwritev_all(fd, [data], 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably: ``path.tmp`` (0600),
    fsync, rename, fsync of the directory."""
    tmp = path + ".tmp"
    write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def fsync_directory(directory: str) -> None:
    """fsync a directory, so that the files created or renamed in it stay after a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwritev_all(fd: int, bufs: list, pos: int) -> None:
    """pwritev every buffer at ``pos``, handling short writes and IOV_MAX."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    while views:
        batch = views[:IOV_MAX]
        n = os.pwritev(fd, batch, pos)
        pos += n
        while n:
            if n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def _load_fallocate():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fallocate = libc.fallocate
    except (OSError, AttributeError):  # not glibc/Linux: no reservation
        return None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    return fallocate


_fallocate = _load_fallocate()


def reserve(fd: int, offset: int, length: int) -> bool:
    """Allocate disk blocks for bytes [offset, offset + length) of ``fd`` without changing
    its size, so that appends there cannot fail with ENOSPC. False if the file system
    or platform cannot; raises ``OSError`` (ENOSPC: the disk is full)."""
    if _fallocate is None:
        return False
    if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(code, os.strerror(code))


def release_reserved(path: str) -> bool:
    """Free the blocks reserved beyond the end of file ``path`` (``reserve``), so that
    another file can use them; False if there were none to free or it could not."""
    if _fallocate is None:
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        blocks = os.fstat(fd).st_blocks * 512
        if blocks <= size:
            return False
        flags = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        return _fallocate(fd, flags, size, blocks - size + (1 << 20)) == 0
    finally:
        os.close(fd)


def copy_aside(fd: int, start: int, end: int, dest: str) -> bool:
    """Copy bytes [start, end) of ``fd`` to a new file ``dest`` (0600, fsynced) for
    inspection; False if ``dest`` exists already or the copy failed (it is removed)."""
    if os.path.exists(dest):
        return False
    try:
        out = create_file(dest)
    except OSError:
        return False
    try:
        pos = start
        while pos < end:
            chunk = os.pread(fd, min(end - pos, 1 << 20), pos)
            if not chunk:
                break
            os.write(out, chunk)
            pos += len(chunk)
        os.fsync(out)
    except OSError:
        os.close(out)
        with contextlib.suppress(OSError):
            os.unlink(dest)
        return False
    os.close(out)
    with contextlib.suppress(OSError):
        fsync_directory(os.path.dirname(dest))
    return True
