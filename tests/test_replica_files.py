"""A follower's copy on disk (``raymq.storage.mirror.ReplicaFiles``): commits it
refuses, and what a cut and an install leave behind after a write, an unlink or a
directory sync failed. Most were found by the simulator's replicated mode: each stale
file or tail outlived a catch-up, and a promoted copy served records the leader had
given other messages."""

from __future__ import annotations

import asyncio
import errno
import os

import numpy as np
import pytest

from raymq.core.replication import Fenced, ReplicationFollower
from raymq.storage import mirror as mirror_module
from raymq.storage.mirror import Diverged, MirrorWrite, ReplicaFiles
from tests.test_replication import follower, open_leader, send, until_in_sync


def test_replica_files_refuse_a_write_that_does_not_continue_them(tmp_path):
    files = ReplicaFiles(str(tmp_path / "f"), "rq")
    f = ReplicationFollower(files, epoch=3)
    w = MirrorWrite(epoch=3, seq=1, end_offset=5)
    w.records.append(("00000000000000000000.seg", 40, [np.zeros(10, dtype=np.uint8)]))
    with pytest.raises(Diverged):
        f.apply(3, w)
    with pytest.raises(Fenced):
        f.apply(2, MirrorWrite(epoch=2, seq=1, end_offset=0))
    assert files.sizes == {}


def _follower_copy(root) -> str:
    """A follower's directory holding 200 messages over several segment files."""

    async def main():
        links = [follower(root, "r1")]
        core, rep, _ = open_leader(root, links)
        await until_in_sync(rep, 2)
        await send(core, 0, 200)
        await core.close()
        links[0].follower.files.close()

    asyncio.run(main())
    return os.path.join(root, "r1")


def _failing_once(monkeypatch, module, name: str, calls: list[str]) -> None:
    """``module.name`` fails with EIO at its first call; every call is noted."""
    real = getattr(module, name)

    def call(path, *args, **kwargs):
        calls.append(f"{name} {os.path.basename(path)}")
        if len(calls) == 1:
            raise OSError(errno.EIO, "injected", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(module, name, call)


def test_a_cut_whose_unlink_failed_removes_the_file_at_the_next_try(tmp_path, monkeypatch):
    """Found by the replicated simulator: a failed unlink forgot the file anyway; the
    catch-up's next cut left it on disk, to come back at the next open with records
    the leader had given other messages to."""
    directory = _follower_copy(tmp_path)
    files = ReplicaFiles(directory, "rq")
    last = max(files.sizes)
    calls: list[str] = []
    _failing_once(monkeypatch, mirror_module.os, "unlink", calls)
    with pytest.raises(OSError):
        files.truncate_to(int(last[: -len(".seg")]))
    files.truncate_to(int(last[: -len(".seg")]))
    assert not os.path.exists(os.path.join(directory, last))
    assert last not in ReplicaFiles(directory, "rq").sizes


def test_an_unlink_that_failed_after_the_name_was_gone_forgets_it(tmp_path, monkeypatch):
    """Found by the replicated simulator: the unlink took effect, then failed; the copy
    still counted the file, and every later cut failed on it (FileNotFoundError): the
    follower was never in sync again."""
    directory = _follower_copy(tmp_path)
    files = ReplicaFiles(directory, "rq")
    last = max(files.sizes)
    real = mirror_module.os.unlink

    def gone_then_fails(path, *args, **kwargs):
        real(path, *args, **kwargs)
        raise OSError(errno.EIO, "injected", path)

    monkeypatch.setattr(mirror_module.os, "unlink", gone_then_fails)
    with pytest.raises(OSError):
        files.truncate_to(int(last[: -len(".seg")]))
    monkeypatch.undo()
    assert last not in files.sizes
    files.truncate_to(int(last[: -len(".seg")]))


def test_a_cut_syncs_its_directory_even_when_nothing_is_left_to_remove(tmp_path, monkeypatch):
    """Found by the replicated simulator: a cut whose directory sync failed is tried
    again; the second found nothing to remove and synced nothing, so a crash could
    bring back the removed file."""
    directory = _follower_copy(tmp_path)
    files = ReplicaFiles(directory, "rq")
    last = max(files.sizes)
    calls: list[str] = []
    _failing_once(monkeypatch, mirror_module, "fsync_directory", calls)
    with pytest.raises(OSError):
        files.truncate_to(int(last[: -len(".seg")]))
    files.truncate_to(int(last[: -len(".seg")]))
    assert calls == ["fsync_directory r1", "fsync_directory r1"]


def test_a_segment_whose_first_write_failed_is_removed_by_the_next_cut(tmp_path, monkeypatch):
    """Found by the replicated simulator: a commit that opened a new segment file on a
    follower and failed to write it left a file the follower did not know of; cut and
    caught up, it kept it, and once promoted served its stale record at an offset the
    leader had given another message."""
    directory = _follower_copy(tmp_path)
    files = ReplicaFiles(directory, "rq")
    end = files.end_offset
    name = f"{end:020d}.seg"
    write = MirrorWrite(epoch=1, seq=files.seq + 1, end_offset=end + 1)
    write.records.append((name, 0, [np.zeros(64, dtype=np.uint8)]))

    def failing(fd, bufs, pos):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(mirror_module, "pwritev_all", failing)
    with pytest.raises(OSError):
        files.apply(write)
    monkeypatch.undo()
    assert os.path.exists(os.path.join(directory, name))
    files.truncate_to(end)
    assert not os.path.exists(os.path.join(directory, name))


def test_a_write_that_failed_after_its_bytes_landed_is_cut_away(tmp_path, monkeypatch):
    """Found by the replicated simulator: a commit's bytes reached a follower's file,
    then the write failed; the follower counted the file at its old length, so a cut
    and an install left the stale records after it, where a promoted copy would have
    served them."""
    directory = _follower_copy(tmp_path)
    files = ReplicaFiles(directory, "rq")
    end = files.end_offset
    name = max(files.sizes)
    size = files.sizes[name]
    write = MirrorWrite(epoch=1, seq=files.seq + 1, end_offset=end + 1)
    write.records.append((name, size, [np.full(64, 7, dtype=np.uint8)]))
    real = mirror_module.pwritev_all

    def lands_then_fails(fd, bufs, pos):
        real(fd, bufs, pos)
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(mirror_module, "pwritev_all", lands_then_fails)
    with pytest.raises(OSError):
        files.apply(write)
    monkeypatch.undo()
    path = os.path.join(directory, name)
    assert os.path.getsize(path) == size + 64
    files.truncate_to(end)
    assert os.path.getsize(path) == size
    files.install(dict(files.sizes), {}, [(1, 0)], end, 0)
    assert os.path.getsize(path) == size


def test_an_install_makes_the_leaders_segments_durable_before_it_removes_others(
    tmp_path, monkeypatch
):
    """Found by the replicated simulator: an install removed the segment files the
    leader does not hold before it synced the ones it copied; a crash in between left
    the follower without records it had acknowledged."""
    directory = _follower_copy(tmp_path)
    files = ReplicaFiles(directory, "rq")
    first, last = min(files.sizes), max(files.sizes)
    files.write_chunk(last, files.sizes[last], np.full(32, 1, dtype=np.uint8), sync=False)
    kept = {n: size for n, size in files.sizes.items() if n != first}
    calls: list[str] = []
    for module, name in ((mirror_module.os, "fdatasync"), (mirror_module.os, "unlink")):
        real = getattr(module, name)

        def noted(arg, *rest, _real=real, _name=name):
            calls.append(_name)
            return _real(arg, *rest)

        monkeypatch.setattr(module, name, noted)
    real_dir_sync = mirror_module.fsync_directory
    monkeypatch.setattr(
        mirror_module, "fsync_directory", lambda d: (calls.append("dirsync"), real_dir_sync(d))
    )
    files.install(kept, {}, [(1, 0)], files.end_offset, 0)
    assert not os.path.exists(os.path.join(directory, first))
    removed = calls.index("unlink")
    assert "fdatasync" in calls[:removed] and "dirsync" in calls[:removed], calls


def _copy_end(directory: str) -> int:
    """Where a copy ends as its recovery finds it when promoted: past its records or at
    its checkpoint's next offset, whichever is later."""
    from raymq.storage.checkpoint import read_checkpoint

    ckpt, _damage = read_checkpoint(directory)
    return max(ReplicaFiles(directory, "rq").end_offset, ckpt["next_offset"] if ckpt else 0)


def test_an_install_whose_small_files_fail_keeps_the_segments_the_leader_deleted(
    tmp_path, monkeypatch
):
    """Found by the replicated simulator (seeds 2605599 and 2607096): an install removed
    the segment files the leader had deleted (every message acknowledged) before it
    wrote the leader's checkpoint; a write of the small files that failed then (a crash
    alike) left the copy ending short of what it had acknowledged, at its old
    checkpoint's next offset: promoted, it would give those offsets again."""
    from raymq.storage.checkpoint import encode_checkpoint

    directory = _follower_copy(tmp_path)
    files = ReplicaFiles(directory, "rq")
    end = files.end_offset
    assert end == 200 and _copy_end(directory) == 200
    leaders = {"checkpoint": encode_checkpoint([], next_offset=end, ack_generation=7)}
    calls: list[str] = []
    _failing_once(monkeypatch, mirror_module, "write_file_atomic", calls)
    with pytest.raises(OSError):
        files.install({}, leaders, [(1, 0)], end, 0)  # the leader deleted every segment
    files.close()
    assert calls == ["write_file_atomic checkpoint"]
    assert _copy_end(directory) >= end
    # Installed again, it holds the leader's state: no segment, the same next offset.
    files = ReplicaFiles(directory, "rq")
    files.install({}, leaders, [(1, 0)], end, 0)
    files.close()
    assert ReplicaFiles(directory, "rq").sizes == {} and _copy_end(directory) == end
