"""SimDisk: real files under one directory, watched at the system-call level so that a
crash can be taken after any call, and any call can fail the way a disk does.

The storage engine talks to the disk through ``os`` functions; while a ``SimDisk`` is
installed, those of them that touch files under its root are wrapped:

* It keeps, per file (an "inode": an identity that follows renames), the bytes that an
  ``fsync``/``fdatasync`` made durable, and per directory the names a directory
  ``fsync`` made durable. That is enough to build what a crash after any call could
  leave on disk (``crash_image``), in the POSIX model: bytes written since the last
  sync may be lost, kept in part, or kept with holes of zeros (pages written back out
  of order); a name created, renamed or unlinked since the directory's last sync may
  or may not have reached the disk.
* ``fail_rate`` makes any wrapped call fail with ``EIO`` or ``ENOSPC``, before or after
  the call did its work (a sync that fails may or may not have synced: the model takes
  the worse for the caller, the bytes are durable).
* ``full`` fills the disk: a call that needs new space fails with ``ENOSPC`` (writes
  beyond a file's allocated length, new files), while writes into space reserved with
  ``fallocate`` still succeed, as on a real file system.
* ``flip`` flips a bit anywhere in a file (but those named in ``unflippable``),
  durably (rot).

Every decision is drawn from the ``random.Random`` given, so a seed replays a run.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from raymq.storage import files as storage_files
from raymq.storage.lock import LOCK_NAME

#: Calls that may fail with an injected error, with the errors they may get.
_FALLIBLE: dict[str, tuple[int, ...]] = {
    "open": (errno.EIO, errno.ENOSPC, errno.EMFILE),
    "pwritev": (errno.EIO, errno.ENOSPC),
    "write": (errno.EIO, errno.ENOSPC),
    "writev": (errno.EIO, errno.ENOSPC),
    "fsync": (errno.EIO,),
    "fdatasync": (errno.EIO,),
    "ftruncate": (errno.EIO,),
    "unlink": (errno.EIO, errno.EROFS),
    "replace": (errno.EIO, errno.ENOSPC),
    "pread": (errno.EIO,),
    "fallocate": (errno.EIO, errno.ENOSPC),
}
#: Calls whose failure may come after their effect (the bytes reached the file).
_MAY_FAIL_AFTER = {"pwritev", "write", "writev", "fsync", "fdatasync", "ftruncate", "unlink"}
_WRAPPED = (
    "open",
    "close",
    "pwritev",
    "write",
    "writev",
    "fsync",
    "fdatasync",
    "ftruncate",
    "unlink",
    "replace",
    "pread",
    "mkdir",
)
#: Wrapped calls that name a path (the others take a file descriptor).
_BY_PATH = frozenset({"open", "unlink", "replace", "mkdir"})
#: Size of the pages a crash keeps or loses independently.
PAGE = 4096


@dataclass(eq=False)
class Inode:
    """One file, whatever its name."""

    number: int
    #: Bytes an fsync/fdatasync made durable (a new file: none).
    synced: bytes = b""
    #: Bytes the disk holds room for (size, or more with fallocate).
    allocated: int = 0


@dataclass
class Fd:
    path: str
    inode: Inode | None  # None: a directory
    append: bool = False


@dataclass
class CrashImage:
    """What the disk holds after a crash: file contents by path relative to the root,
    and the directories."""

    files: dict[str, bytes] = field(default_factory=dict)
    directories: set[str] = field(default_factory=set)
    #: What happened to each file, for a reproduction's report.
    notes: list[str] = field(default_factory=list)


class InjectedCrash(Exception):
    """Not raised: a marker a run uses to say "the crash point was here"."""


class SimDisk:
    """Watches and disturbs system calls on files under ``root``; see the module doc."""

    def __init__(self, root: str, rng: random.Random):
        self.root = os.path.abspath(root)
        self.rng = rng
        #: Probability that a wrapped call fails with an injected error.
        self.fail_rate = 0.0
        #: The disk is full: calls that need new space fail with ENOSPC.
        self.full = False
        #: Take a crash image after this many more wrapped calls (None: never).
        self.crash_after: int | None = None
        #: The image taken at the crash point, once it is reached.
        self.image: CrashImage | None = None
        self.calls = 0
        self.injected: list[str] = []  # "call path errno" of each injected failure
        #: Names of files ``flip`` leaves alone (an address's ``subscriptions`` file: rot
        #: there stops the address from opening by design, until an operator acts).
        self.unflippable: frozenset[str] = frozenset()
        self._orig: dict[str, Callable] = {}
        self._fds: dict[int, Fd] = {}
        self._live: dict[str, Inode] = {}  # path -> inode, files under root
        self._durable: dict[str, dict[str, Inode]] = {}  # directory -> name -> inode
        self._dirs: set[str] = {self.root}
        self._inodes = 0
        self._orig_fallocate = None

    # -- installing ---------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self) -> Iterator[SimDisk]:
        """Wrap the ``os`` functions (and the storage's fallocate) while in the block."""
        for name in _WRAPPED:
            self._orig[name] = getattr(os, name)
            setattr(os, name, getattr(self, "_" + name))
        self._orig_fallocate = storage_files._fallocate
        if self._orig_fallocate is not None:
            storage_files._fallocate = self._fallocate
        try:
            yield self
        finally:
            for name, fn in self._orig.items():
                setattr(os, name, fn)
            storage_files._fallocate = self._orig_fallocate

    @staticmethod
    @contextlib.contextmanager
    def installed_together(disks: list[SimDisk]) -> Iterator[list[SimDisk]]:
        """Install several disks at once, each watching its own root (one per node of
        a replicated run): a call on a path goes to the disk whose root holds it, a
        call on a file descriptor to the disk that opened it."""
        orig = {name: getattr(os, name) for name in _WRAPPED}
        orig_fallocate = storage_files._fallocate
        for disk in disks:
            disk._orig, disk._orig_fallocate = dict(orig), orig_fallocate

        def by_path(name: str) -> Callable:
            def call(path, *args, **kwargs):
                for disk in disks:
                    if disk._mine(path):
                        return getattr(disk, "_" + name)(path, *args, **kwargs)
                return orig[name](path, *args, **kwargs)

            return call

        def by_fd(name: str, real: Callable) -> Callable:
            def call(fd, *args, **kwargs):
                for disk in disks:
                    if fd in disk._fds:
                        return getattr(disk, "_" + name)(fd, *args, **kwargs)
                return real(fd, *args, **kwargs)

            return call

        for name in _WRAPPED:
            wrapper = by_path(name) if name in _BY_PATH else by_fd(name, orig[name])
            setattr(os, name, wrapper)
        if orig_fallocate is not None:
            storage_files._fallocate = by_fd("fallocate", orig_fallocate)
        try:
            yield disks
        finally:
            for name, fn in orig.items():
                setattr(os, name, fn)
            storage_files._fallocate = orig_fallocate

    def _mine(self, path: object) -> bool:
        if not isinstance(path, str):
            return False
        path = os.path.abspath(path)
        return path == self.root or path.startswith(self.root + os.sep)

    def _call(self, name: str, path: str, *, needs_space: bool = False) -> bool:
        """Count a call on ``path``; take the crash image if it is the chosen one; raise
        an injected error before the call, or return True to raise one after it."""
        self.calls += 1
        if self.crash_after is not None and self.image is None:
            self.crash_after -= 1
            if self.crash_after < 0:
                self.image = self.crash_image()
        if self.full and needs_space:
            self._inject(name, path, errno.ENOSPC)
        if self.fail_rate and name in _FALLIBLE and self.rng.random() < self.fail_rate:
            code = self.rng.choice(_FALLIBLE[name])
            if name in _MAY_FAIL_AFTER and self.rng.random() < 0.5:
                self.injected.append(f"{name} {path} {errno.errorcode[code]} (after)")
                return True
            self._inject(name, path, code)
        return False

    def _inject(self, name: str, path: str, code: int) -> None:
        self.injected.append(f"{name} {path} {errno.errorcode[code]}")
        raise OSError(code, os.strerror(code), path)

    def _after(self, name: str, path: str) -> None:
        code = self.rng.choice([c for c in _FALLIBLE[name] if c != errno.ENOSPC] or [errno.EIO])
        raise OSError(code, os.strerror(code), path)

    def _new_inode(self) -> Inode:
        self._inodes += 1
        return Inode(self._inodes)

    # -- wrapped calls ------------------------------------------------------------------

    def _open(self, path, flags, mode=0o777, *, dir_fd=None):
        # The LOCK file is not state (docs/FORMAT.md): left out, so that seeds keep the
        # trajectories they had before it.
        if dir_fd is not None or not self._mine(path) or os.path.basename(path) == LOCK_NAME:
            return self._orig["open"](path, flags, mode, dir_fd=dir_fd)
        path = os.path.abspath(path)
        creating = bool(flags & os.O_CREAT) and path not in self._live
        self._call("open", path, needs_space=creating)
        fd = self._orig["open"](path, flags, mode)
        if path in self._dirs or os.path.isdir(path):
            self._fds[fd] = Fd(path, None)
            return fd
        inode = self._live.get(path)
        if inode is None:
            inode = self._live[path] = self._new_inode()
        if flags & os.O_TRUNC:
            inode.allocated = 0
        self._fds[fd] = Fd(path, inode, append=bool(flags & os.O_APPEND))
        return fd

    def _close(self, fd):
        self._fds.pop(fd, None)
        return self._orig["close"](fd)

    def _size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def _write_call(self, name: str, fd: int, pos: int | None, n: int, do):
        f = self._fds.get(fd)
        if f is None or f.inode is None:
            return do()
        start = self._size(fd) if pos is None or f.append else pos
        needs = start + n > max(f.inode.allocated, self._size(fd))
        after = self._call(name, f.path, needs_space=needs)
        result = do()
        f.inode.allocated = max(f.inode.allocated, self._size(fd))
        if after:
            self._after(name, f.path)
        return result

    def _pwritev(self, fd, buffers, pos, *args):
        n = sum(memoryview(b).nbytes for b in buffers)
        return self._write_call(
            "pwritev", fd, pos, n, lambda: self._orig["pwritev"](fd, buffers, pos, *args)
        )

    def _write(self, fd, data):
        n = memoryview(data).nbytes
        return self._write_call("write", fd, None, n, lambda: self._orig["write"](fd, data))

    def _writev(self, fd, buffers):
        n = sum(memoryview(b).nbytes for b in buffers)
        return self._write_call("writev", fd, None, n, lambda: self._orig["writev"](fd, buffers))

    def _sync(self, name: str, fd: int):
        f = self._fds.get(fd)
        if f is None:
            return self._orig[name](fd)
        after = self._call(name, f.path)
        # No real sync: what is durable is what this class says (and it is faster).
        result = None
        if f.inode is None:  # a directory: the names in it are durable now
            self._durable[f.path] = self._names_in(f.path)
        else:
            f.inode.synced = self._read_all(fd)
        if after:
            self._after(name, f.path)
        return result

    def _fsync(self, fd):
        return self._sync("fsync", fd)

    def _fdatasync(self, fd):
        return self._sync("fdatasync", fd)

    def _ftruncate(self, fd, length):
        f = self._fds.get(fd)
        if f is None or f.inode is None:
            return self._orig["ftruncate"](fd, length)
        after = self._call("ftruncate", f.path)
        result = self._orig["ftruncate"](fd, length)
        f.inode.allocated = length  # truncation frees the space beyond, reserved or not
        if after:
            self._after("ftruncate", f.path)
        return result

    def _unlink(self, path, *, dir_fd=None):
        if dir_fd is not None or not self._mine(path):
            return self._orig["unlink"](path, dir_fd=dir_fd)
        path = os.path.abspath(path)
        after = self._call("unlink", path)
        result = self._orig["unlink"](path)
        self._live.pop(path, None)
        if after:
            self._after("unlink", path)
        return result

    def _replace(self, src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        if not (self._mine(src) and self._mine(dst)):
            return self._orig["replace"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        self._call("replace", dst)
        result = self._orig["replace"](src, dst)
        inode = self._live.pop(src, None)
        if inode is not None:
            self._live[dst] = inode
        return result

    def _pread(self, fd, n, pos):
        f = self._fds.get(fd)
        if f is not None and f.inode is not None:
            self._call("pread", f.path)
        return self._orig["pread"](fd, n, pos)

    def _mkdir(self, path, mode=0o777, *, dir_fd=None):
        result = self._orig["mkdir"](path, mode, dir_fd=dir_fd)
        if dir_fd is None and self._mine(path):
            self._dirs.add(os.path.abspath(path))
        return result

    def _fallocate(self, fd, mode, offset, length):
        f = self._fds.get(fd)
        if f is not None and f.inode is not None:
            try:
                self._call("fallocate", f.path, needs_space=offset + length > f.inode.allocated)
            except OSError as exc:
                ctypes.set_errno(exc.errno)
                return -1
            f.inode.allocated = max(f.inode.allocated, offset + length)
        return self._orig_fallocate(fd, mode, offset, length)

    def _names_in(self, directory: str) -> dict[str, Inode]:
        """The files now in ``directory``: name -> inode."""
        return {
            os.path.basename(p): i for p, i in self._live.items() if os.path.dirname(p) == directory
        }

    def _read_all(self, fd: int) -> bytes:
        size = self._size(fd)
        return self._orig["pread"](fd, size, 0) if size else b""

    def _read_path(self, path: str) -> bytes | None:
        try:
            fd = self._orig["open"](path, os.O_RDONLY)
        except OSError:
            return None
        try:
            return self._read_all(fd)
        finally:
            self._orig["close"](fd)

    # -- rot ----------------------------------------------------------------------------

    def flip(self, path: str | None = None) -> str | None:
        """Flip one bit of a file under the root (a random one if ``path`` is None),
        in the file and in what is durable of it; returns "path@byte" or None."""
        candidates = sorted(
            p
            for p in list(self._live)
            if os.path.basename(p) not in self.unflippable and os.path.getsize(p) > 0
        )
        if path is None:
            if not candidates:
                return None
            path = self.rng.choice(candidates)
        size = os.path.getsize(path)
        if not size:
            return None
        pos = self.rng.randrange(size)
        mask = 1 << self.rng.randrange(8)
        fd = self._orig["open"](path, os.O_RDWR)
        try:
            byte = self._orig["pread"](fd, 1, pos)[0]
            self._orig["pwritev"](fd, [bytes([byte ^ mask])], pos)
        finally:
            self._orig["close"](fd)
        inode = self._live[path]
        if pos < len(inode.synced):
            synced = bytearray(inode.synced)
            synced[pos] ^= mask
            inode.synced = bytes(synced)
        return f"{os.path.relpath(path, self.root)}@{pos}"

    # -- crashes ------------------------------------------------------------------------

    def crash_image(self) -> CrashImage:
        """What a crash now could leave on disk (drawn at random, see the module doc)."""
        image = CrashImage(directories={os.path.relpath(d, self.root) for d in self._dirs})
        rng = self.rng
        for directory in sorted(self._dirs):
            durable = self._durable.get(directory, {})
            live = self._names_in(directory)
            for name in sorted(set(durable) | set(live)):
                was, now = durable.get(name), live.get(name)
                inode = was if was is now else rng.choice([was, now])
                rel = os.path.relpath(os.path.join(directory, name), self.root)
                if inode is not now:
                    state = "lost (never synced)" if inode is None else "as last synced"
                    image.notes.append(f"{rel}: name {state}")
                if inode is None:
                    continue
                path = os.path.join(directory, name)
                current = self._read_path(path) if inode is now else None
                data, how = self._crashed_bytes(inode, current)
                image.files[rel] = data
                if how:
                    image.notes.append(f"{rel}: {how}")
        return image

    def _crashed_bytes(self, inode: Inode, current: bytes | None) -> tuple[bytes, str]:
        """The bytes of one file after a crash, and what happened to them ("" if it
        holds what was synced or everything)."""
        synced = inode.synced
        if current is None or current == synced:
            return synced, ""
        rng = self.rng
        if not current.startswith(synced):  # truncated or overwritten since the sync
            return (synced, "truncation lost") if rng.random() < 0.5 else (current, "")
        tail = current[len(synced) :]
        mode = rng.random()
        if mode < 0.3:
            return synced, f"unsynced {len(tail)} bytes lost"
        if mode < 0.55:
            return current, ""
        if mode < 0.8:
            cut = rng.randrange(len(tail))
            return synced + tail[:cut], f"unsynced tail torn at {len(synced) + cut}"
        # Pages written back out of order: some pages of the tail kept, others zeros.
        out = bytearray(current)
        lost = []
        for start in range(len(synced) - len(synced) % PAGE, len(current), PAGE):
            if rng.random() < 0.5:
                lo = max(start, len(synced))
                out[lo : start + PAGE] = bytes(len(out[lo : start + PAGE]))
                lost.append(start)
        return bytes(out), f"unsynced pages zeroed at {lost}"

    def restore(self, image: CrashImage) -> None:
        """Make the root hold exactly ``image`` (as after a reboot: everything durable),
        and forget what was being tracked. Call with the queue's files closed."""
        for fd in list(self._fds):
            with contextlib.suppress(OSError):
                self._orig["close"](fd)
        self._fds.clear()
        for directory, _subdirs, names in os.walk(self.root, topdown=False):
            for name in names:
                self._orig["unlink"](os.path.join(directory, name))
        self._live.clear()
        self._durable.clear()
        for rel in sorted(image.directories):
            path = os.path.normpath(os.path.join(self.root, rel))
            os.makedirs(path, exist_ok=True)
            self._dirs.add(path)
        for rel, data in image.files.items():
            path = os.path.join(self.root, rel)
            fd = self._orig["open"](path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if data:
                    self._orig["pwritev"](fd, [data], 0)
            finally:
                self._orig["close"](fd)
            inode = self._new_inode()
            inode.synced = data
            inode.allocated = len(data)
            self._live[path] = inode
        for directory in self._dirs:
            self._durable[directory] = self._names_in(directory)
        self.image = None
        self.crash_after = None
