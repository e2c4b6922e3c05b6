"""Helpers that drive a SegmentLog the way the queue actor does, without Ray, and that
damage its files or make its system calls fail."""

from __future__ import annotations

import contextlib
import errno as errno_codes
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import numpy as np

from raymq.batch import MessageBatch
from raymq.storage import SegmentLog
from raymq.storage.format import SEGMENT_HEADER_V1, SEGMENT_MAGIC, segment_name
from raymq.storage.record import encode_record

NOW_US = 1_700_000_000_000_000


def batch(bodies: list[bytes], props=None) -> MessageBatch:
    """A batch of ``bodies`` (and properties) as a client would send it."""
    return MessageBatch.from_bodies(bodies, props, max_message_size=2**30)


def commit(
    log: SegmentLog, bodies: list[bytes] | None = None, props=None, *, checkpoint: bool = False
) -> list[int]:
    """Append ``bodies`` (maybe none) and flush pending acks in one group commit, as
    QueueCore does; raises what ``write`` raises (after ``abort``)."""
    batches = [batch(bodies, props)] if bodies else []
    prepared = log.prepare(batches, NOW_US, checkpoint=checkpoint)
    try:
        log.write(prepared)
    except Exception:
        log.abort(prepared)
        raise
    log.publish(prepared)
    log.unlink_deleted()  # as QueueCore does after each commit
    return [o for b in batches for o in range(b.first_offset, b.end_offset)]


def read_all(log: SegmentLog) -> dict[int, bytes]:
    """Every unacknowledged message as {offset: body}."""
    out = {}
    offsets = log.unacked(0, 10**12)
    if not len(offsets):
        return out
    for b in log.read(int(offsets[0]), int(offsets[-1]) + 1):
        for i in range(len(b)):
            out[b.first_offset + i] = b.body(i)
    acked = log.is_acked(np.fromiter(out, dtype=np.int64))
    return {o: b for (o, b), a in zip(out.items(), acked, strict=True) if not a}


# -- damaging files ---------------------------------------------------------------------


def flip(path: str, position: int, mask: int = 0x01) -> None:
    """Flip bits of one byte of a file in place."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ mask]))


def truncate(path: str, size: int) -> None:
    """Cut a file to ``size`` bytes."""
    os.truncate(path, size)


def write_v1_segment(directory: str, base: int, records: list[list[bytes]]) -> str:
    """Write a version-1 segment file (no salt) holding one record per list of bodies,
    offsets from ``base``; returns its path."""
    path = os.path.join(directory, segment_name(base))
    data = [SEGMENT_HEADER_V1.pack(SEGMENT_MAGIC, 1, 0, base)]
    pos, offset = SEGMENT_HEADER_V1.size, base
    for bodies in records:
        b = batch(bodies)
        b.first_offset = offset
        b.timestamps = np.full(len(b), NOW_US, dtype=np.int64)
        bufs = [bytes(memoryview(x).cast("B")) for x in encode_record(b, None, pos)]
        data.extend(bufs)
        pos += sum(len(x) for x in bufs)
        offset += len(b)
    with open(path, "wb") as f:
        f.write(b"".join(data))
    return path


def copy_queue(src: str, dst: str) -> str:
    """A copy of a queue directory (to damage one file per trial)."""
    shutil.copytree(src, dst)
    return dst


# -- failing system calls ---------------------------------------------------------------


def fd_path(fd: int) -> str:
    """The path an open file descriptor refers to ("" if unknown)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def open_fds() -> int:
    """How many file descriptors this process has open."""
    return len(os.listdir("/proc/self/fd"))


class Faults:
    """Makes chosen ``os`` functions fail with an errno, as a full or failing disk would.

    ``fail("pwritev", errno.ENOSPC, match=".seg")`` makes every ``os.pwritev`` on a file
    whose path contains ``.seg`` raise ENOSPC until ``heal()``; ``times=n`` fails only
    the next n matching calls; ``after=True`` does the call first, then raises (the
    bytes reached the file but the caller sees an error). Built on pytest's monkeypatch.
    """

    def __init__(self, monkeypatch):
        self._mp = monkeypatch
        self._rules: dict[str, list[dict]] = {}
        self.failed: list[tuple[str, str]] = []  # (function, path) of each injected error

    def fail(
        self,
        name: str,
        code: int = errno_codes.EIO,
        *,
        match: str | Callable[[str], bool] = "",
        times: int | None = None,
        after: bool = False,
    ) -> None:
        """Fail ``os.<name>`` on paths containing ``match`` (or for which it is true)."""
        if name not in self._rules:
            self._rules[name] = []
            original = getattr(os, name)
            self._mp.setattr(os, name, self._wrap(name, original))
        self._rules[name].append({"code": code, "match": match, "times": times, "after": after})

    def heal(self) -> None:
        """Every call succeeds again."""
        for rules in self._rules.values():
            rules.clear()

    def _wrap(self, name: str, original):
        def wrapper(*args, **kwargs):
            rule, path = self._rule_for(name, args)
            if rule is None:
                return original(*args, **kwargs)
            if rule["times"] is not None:
                rule["times"] -= 1
            self.failed.append((name, path))
            if rule["after"]:
                original(*args, **kwargs)
            raise OSError(rule["code"], os.strerror(rule["code"]), path)

        return wrapper

    def _rule_for(self, name: str, args: tuple) -> tuple[dict | None, str]:
        rules = self._rules.get(name)
        if not rules:
            return None, ""
        target = args[0] if args else ""
        path = fd_path(target) if isinstance(target, int) else os.fspath(target)
        for rule in rules:
            if rule["times"] is not None and rule["times"] <= 0:
                continue
            m = rule["match"]
            if (m(path) if callable(m) else m in path) and path:
                return rule, path
        return None, path


# -- a small real disk ------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(path: str, size: str = "2m") -> Iterator[str | None]:
    """Mount a tmpfs of ``size`` at ``path`` for the block; yields None (and mounts
    nothing) when mounting is not permitted here."""
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True, check=False)
