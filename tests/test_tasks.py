"""Tasks without Ray: the task message, the retry schedule and the result store."""

from __future__ import annotations

import os

import msgpack
import pytest

from raymq.core.tasks import (
    CANCELLED,
    FAILURE,
    PENDING,
    STARTED,
    SUCCESS,
    TASK_ID_PROPERTY,
    TASK_NAME_PROPERTY,
    RetryPolicy,
    TaskEnvelope,
    UndecodableTask,
    replicas_for_backlog,
)
from raymq.errors import InvalidSetting, StorageError
from raymq.storage.task_results import FILE_NAME, TaskResults


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_task_round_trips_through_its_message():
    task = TaskEnvelope("resize", [1, "a", b"\x00"], {"k": [1.5, None]}, created_at=12.5)
    back = TaskEnvelope.decode(task.encode())
    assert back == task
    assert task.properties() == {TASK_ID_PROPERTY: task.id, TASK_NAME_PROPERTY: "resize"}
    assert TaskEnvelope("x").id != TaskEnvelope("x").id


@pytest.mark.parametrize(
    "body",
    [b"", b"\xc1", b"not msgpack at all \xff", msgpack.packb([2, "id", "n", [], {}, 0.0])],
)
def test_a_body_that_is_not_a_task_is_undecodable(body):
    with pytest.raises(UndecodableTask):
        TaskEnvelope.decode(body)


def test_arguments_that_are_not_msgpack_values_are_refused_naming_the_task():
    with pytest.raises(TypeError, match="'resize'"):
        TaskEnvelope("resize", [object()]).encode()


def test_retries_wait_longer_each_time_up_to_the_cap():
    policy = RetryPolicy(max_retries=5, retry_delay_s=1.0, retry_backoff=2.0, max_retry_delay_s=5)
    assert [policy.delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert [policy.retries_left(n) for n in range(1, 8)] == [True] * 5 + [False] * 2
    assert RetryPolicy(max_retries=0).retries_left(1) is False
    assert RetryPolicy(retry_backoff=1e300).delay(10) == 60.0  # overflow: the cap


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_retries": -1},
        {"max_retries": 1.5},
        {"retry_delay_s": -1},
        {"retry_backoff": 0.5},
        {"max_retry_delay_s": float("nan")},
        {"retry_delay_s": True},
    ],
)
def test_bad_retry_settings_are_refused_by_name(kwargs):
    with pytest.raises(InvalidSetting, match=next(iter(kwargs))):
        RetryPolicy(**kwargs)


def test_a_task_goes_from_pending_to_its_result_and_survives_a_reopen(tmp_path):
    store = TaskResults(str(tmp_path))
    store.pending("t1", "resize", 10.0, 60)
    assert store.get("t1").status == PENDING
    started = store.start("t1", "resize", 60)
    assert (started.status, started.runs) == (STARTED, 1)
    store.finish("t1", SUCCESS, {"pixels": [1, 2]})
    store.close()
    again = TaskResults(str(tmp_path)).get("t1")
    assert (again.status, again.result, again.runs, again.name) == (
        SUCCESS,
        {"pixels": [1, 2]},
        1,
        "resize",
    )


def test_a_failure_keeps_its_type_text_and_traceback(tmp_path):
    store = TaskResults(str(tmp_path))
    store.pending("t", "n", 0.0, 60)
    store.start("t", "n", 60)
    store.finish("t", FAILURE, error_type="KeyError", error="'x'", traceback="Traceback ...")
    record = store.get("t")
    assert (record.status, record.error_type, record.error, record.traceback) == (
        FAILURE,
        "KeyError",
        "'x'",
        "Traceback ...",
    )


def test_runs_count_every_start_and_a_finished_task_never_starts_again(tmp_path):
    store = TaskResults(str(tmp_path))
    store.pending("t", "n", 0.0, 60)
    assert [store.start("t", "n", 60).runs for _ in range(3)] == [1, 2, 3]
    store.finish("t", SUCCESS, 7)
    redelivered = store.start("t", "n", 60)
    assert (redelivered.status, redelivered.runs, redelivered.result) == (SUCCESS, 3, 7)


def test_a_task_started_without_a_pending_record_is_recorded(tmp_path):
    store = TaskResults(str(tmp_path))
    record = store.start("unknown", "n", 60)
    assert (record.status, record.runs, record.name) == (STARTED, 1, "n")


def test_only_a_task_not_started_can_be_cancelled(tmp_path):
    store = TaskResults(str(tmp_path))
    store.pending("a", "n", 0.0, 60)
    store.pending("b", "n", 0.0, 60)
    store.start("b", "n", 60)
    assert store.cancel("a") is True
    assert store.cancel("b") is False
    assert store.cancel("never enqueued") is False
    assert store.start("a", "n", 60).status == CANCELLED  # its delivery must not run it
    assert store.counts() == {
        CANCELLED: 1,
        FAILURE: 0,
        PENDING: 0,
        STARTED: 1,
        SUCCESS: 0,
    }


def test_pending_twice_changes_nothing(tmp_path):
    store = TaskResults(str(tmp_path))
    store.pending("t", "n", 1.0, 60)
    store.start("t", "n", 60)
    store.pending("t", "other", 2.0, 60)
    record = store.get("t")
    assert (record.status, record.name, record.created_at) == (STARTED, "n", 1.0)


def test_finished_tasks_expire_after_their_own_ttl_and_unfinished_ones_never(tmp_path):
    clock = Clock()
    store = TaskResults(str(tmp_path), clock=clock)
    for task_id, ttl in (("short", 10), ("long", 100), ("waiting", 1)):
        store.pending(task_id, "n", clock.now, ttl)
    for task_id in ("short", "long"):
        store.start(task_id, "n", 60)
        store.finish(task_id, SUCCESS, task_id)
    clock.now += 11
    assert store.expire() == 1
    assert store.get("short") is None
    assert store.get("long").result == "long"
    clock.now += 1000
    assert store.expire() == 1
    assert store.get("waiting").status == PENDING


def test_a_result_that_is_not_a_msgpack_value_is_refused_and_nothing_written(tmp_path):
    store = TaskResults(str(tmp_path))
    store.pending("t", "n", 0.0, 60)
    store.start("t", "n", 60)
    with pytest.raises(TypeError, match="msgpack"):
        store.finish("t", SUCCESS, object())
    assert store.get("t").status == STARTED
    with pytest.raises(ValueError, match="final"):
        store.finish("t", STARTED)


def test_a_damaged_store_file_raises_storage_error_naming_it(tmp_path):
    store = TaskResults(str(tmp_path))
    store.pending("t", "n", 0.0, 60)
    store.close()
    path = os.path.join(tmp_path, FILE_NAME)
    for suffix in ("-wal", "-shm"):  # a clean close folded them into the file
        assert not os.path.exists(path + suffix)
    with open(path, "r+b") as f:
        f.write(b"\xff" * 100)  # the header: no longer a database
    with pytest.raises(StorageError, match=FILE_NAME):
        TaskResults(str(tmp_path))


def test_a_backlog_asks_for_enough_replicas_and_none_for_none():
    assert [replicas_for_backlog(n, 10) for n in (0, 1, 10, 11, 95)] == [0, 1, 1, 2, 10]
    assert replicas_for_backlog(-3, 10) == 0
    assert replicas_for_backlog(3, 0.5) == 6
    with pytest.raises(InvalidSetting, match="target_backlog_per_replica"):
        replicas_for_backlog(1, 0)
