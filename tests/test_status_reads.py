"""Task statuses read from the result store's file beside its writer (Ray-free)."""

from __future__ import annotations

import os

import pytest

from raymq.core.tasks import SUCCESS, StoreLocation
from raymq.errors import StorageError
from raymq.serve import status_reads
from raymq.serve.status_reads import NOT_LOCAL, StatusReads
from raymq.storage.task_results import FILE_NAME, TaskResults, TaskResultsReader
from tests.test_consumer_liveness import FakeClock


def test_a_reader_sees_each_commit_of_the_store_and_reads_only_that_store(tmp_path):
    store = TaskResults(str(tmp_path / "a"))
    reader = TaskResultsReader(store.path, store.store_id)
    assert reader.get("t") is None
    store.apply([("start", ("t", "work", 60))])
    assert reader.get("t").status == "STARTED"
    store.apply([("finish", ("t", "work", 60, SUCCESS, {"x": [1, 2]}))])
    record = reader.get("t")
    assert (record.status, record.result, record.runs) == (SUCCESS, {"x": [1, 2]}, 1)
    # The id is the file's: the same store opened again keeps it; another has its own.
    store.close()
    again = TaskResults(str(tmp_path / "a"))
    assert again.store_id == store.store_id
    other = TaskResults(str(tmp_path / "b"))
    assert other.store_id != store.store_id
    with pytest.raises(StorageError, match=FILE_NAME):
        TaskResultsReader(other.path, store.store_id)
    with pytest.raises(StorageError, match="nowhere"):
        TaskResultsReader(str(tmp_path / "nowhere" / FILE_NAME), store.store_id)
    reader.close()


def test_a_result_that_does_not_decode_is_a_storage_error_naming_the_file(tmp_path):
    store = TaskResults(str(tmp_path))
    store.apply([("finish", ("t", "work", 60, SUCCESS, 1))])
    store._db.execute("UPDATE tasks SET result = ? WHERE id = 't'", (b"\xc1",))  # never msgpack
    reader = TaskResultsReader(store.path, store.store_id)
    with pytest.raises(StorageError, match=f"{FILE_NAME}.*task t"):
        reader.get("t")


def test_a_reader_closed_under_a_thread_is_a_storage_error(tmp_path):
    store = TaskResults(str(tmp_path))
    reader = TaskResultsReader(store.path, store.store_id)
    reader.close()  # (as StatusReads drops a failed reader another thread still holds)
    with pytest.raises(StorageError, match=FILE_NAME):
        reader.get("t")


def test_a_reader_never_writes(tmp_path):
    store = TaskResults(str(tmp_path))
    reader = TaskResultsReader(store.path, store.store_id)
    with pytest.raises(Exception, match="readonly"):
        reader._db.execute("DELETE FROM tasks")


class Store:
    """A result store that can move between nodes, and a count of ``locate`` calls."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.store = TaskResults(str(tmp_path / "here"))
        self.node = "node-1"
        self.locates = 0
        self.down = False

    def locate(self) -> StoreLocation:
        self.locates += 1
        if self.down:
            raise ConnectionError("the store's actor is restarting")
        return StoreLocation(self.node, self.store.path, self.store.store_id)


def test_statuses_are_read_from_the_file_on_the_stores_node_and_by_the_actor_elsewhere(
    tmp_path,
):
    store, clock = Store(tmp_path), FakeClock()
    store.store.apply([("start", ("t", "work", 60))])
    here = StatusReads(store.locate, "node-1", clock=clock)
    elsewhere = StatusReads(store.locate, "node-2", clock=clock)
    assert here.get("t").status == "STARTED" and here.get("nothing") is None
    assert elsewhere.get("t") is NOT_LOCAL
    assert (here.local_reads, elsewhere.local_reads, store.locates) == (2, 0, 2)
    # Where the store is, is asked again only after RECHECK_SECONDS.
    clock.now += status_reads.RECHECK_SECONDS - 0.1
    here.get("t")
    assert store.locates == 2
    # The store moved to another node: followed at the next check, never before.
    store.node = "node-3"
    assert here.get("t").status == "STARTED"
    clock.now += 0.2
    assert here.get("t") is NOT_LOCAL and store.locates == 3
    # Back, but its actor is restarting: the reads go to the actor until it answers.
    store.node, store.down = "node-1", True
    clock.now += status_reads.RECHECK_SECONDS
    assert here.get("t") is NOT_LOCAL
    store.down = False
    clock.now += status_reads.RECHECK_SECONDS
    assert here.get("t").status == "STARTED"


class Failing(TaskResultsReader):
    """A reader whose reads fail while ``broken`` (as a disk's would)."""

    broken = False

    def get(self, task_id):
        if Failing.broken:
            raise StorageError(f"task results {self.path}: disk I/O error")
        return super().get(task_id)


def test_a_file_that_is_not_the_stores_or_fails_sends_reads_to_the_actor_counted(tmp_path):
    store, clock = Store(tmp_path), FakeClock()
    reads = StatusReads(store.locate, "node-1", clock=clock, open_reader=Failing)
    assert reads.get("t") is None  # (no record: opened, and read)
    # The store was made again over a new file: its id changed, and the old reader
    # is dropped at the next check.
    os.remove(store.store.path)
    store.store = TaskResults(str(tmp_path / "here"))
    store.store.apply([("start", ("t", "work", 60))])
    clock.now += status_reads.RECHECK_SECONDS
    assert reads.get("t").status == "STARTED"
    # A read that fails: NOT_LOCAL, counted, and the file opened again at the next check.
    Failing.broken = True
    try:
        assert reads.get("t") is NOT_LOCAL and reads.failures == 1
        locates = store.locates
        assert reads.get("t") is NOT_LOCAL and store.locates == locates  # (no reader)
    finally:
        Failing.broken = False
    clock.now += status_reads.RECHECK_SECONDS
    assert reads.get("t").status == "STARTED" and reads.failures == 1
    assert reads.local_reads == 3
