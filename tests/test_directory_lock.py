"""The QueueArea's LOCK file (raymq/storage/lock.py) against a real second process:
while one process has a queue directory open, another waits for it and then gets a
typed error naming the queue and the file; once that process is killed, the directory
opens at once with everything it wrote."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from raymq.errors import StorageError
from raymq.storage import SegmentLog
from raymq.storage import lock as lock_module
from tests.storage_helpers import commit

HOLDER = """
import sys
from raymq.storage import SegmentLog
from tests.storage_helpers import commit
log, _ = SegmentLog.open(sys.argv[1], queue="q", page_size_bytes=1 << 20)
commit(log, [b"m%d" % i for i in range(5)])
print("open", flush=True)
sys.stdin.read()  # hold the directory until killed
"""


def open_log(directory) -> SegmentLog:
    log, _report = SegmentLog.open(str(directory), queue="q", page_size_bytes=1 << 20)
    return log


@pytest.fixture
def holder(tmp_path):
    """A real process holding the queue directory ``tmp_path / "q"`` open, 5 messages in."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "q")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "open"
    yield proc
    proc.kill()
    proc.wait()


def test_a_directory_another_process_holds_is_refused_naming_queue_file_and_holder(
    tmp_path, holder
):
    with pytest.raises(StorageError) as err:
        lock_module.DirectoryLock.acquire(str(tmp_path / "q"), "q", wait_seconds=0.2)
    assert err.value.filename == str(tmp_path / "q" / "LOCK")
    assert "'q'" in str(err.value) and f"pid {holder.pid}" in str(err.value)


def test_an_open_waits_for_a_killed_holder_and_finds_what_it_wrote(tmp_path, holder):
    got: list[SegmentLog | BaseException] = []

    def opener() -> None:
        try:
            got.append(open_log(tmp_path / "q"))
        except BaseException as exc:  # reported below
            got.append(exc)

    thread = threading.Thread(target=opener)
    thread.start()
    assert not got  # an open while the holder lives waits (it may not have tried yet)
    with pytest.raises(StorageError):  # it is held now: refused without waiting
        lock_module.DirectoryLock.acquire(str(tmp_path / "q"), "q", wait_seconds=0)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    thread.join(lock_module.LOCK_WAIT_SECONDS + 10)
    assert len(got) == 1 and isinstance(got[0], SegmentLog), got
    log = got[0]
    try:
        assert log.next_offset == 5 and log.depth == 5
    finally:
        log.close()


def assert_another_process_can_lock(directory) -> None:
    """Another process takes ``directory``'s LOCK at once (and lets it go)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nfrom raymq.storage.lock import DirectoryLock\n"
            "DirectoryLock.acquire(sys.argv[1], 'q', wait_seconds=0).release()\nprint('ok')",
            str(directory),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_close_lets_the_next_opener_in(tmp_path):
    log = open_log(tmp_path / "q")
    commit(log, [b"a", b"b", b"c"])
    log.close()
    # Another process can open it now: the lock went with close.
    assert_another_process_can_lock(tmp_path / "q")


def test_a_recovery_that_fails_with_a_bug_lets_the_directory_go(tmp_path, monkeypatch):
    """Not only OSErrors: whatever ends an open releases the LOCK and the files."""
    import raymq.storage.log as log_module

    open_log(tmp_path / "q").close()

    def broken(self, defer, **settings):
        raise ValueError("a bug in recovery")

    monkeypatch.setattr(log_module.Loader, "recover", broken)
    with pytest.raises(ValueError, match="a bug in recovery"):
        open_log(tmp_path / "q")
    assert_another_process_can_lock(tmp_path / "q")
