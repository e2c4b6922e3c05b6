"""Tasks without Ray: the task message, the retry schedule and the result store."""

from __future__ import annotations

import os

import msgpack
import pytest

from raymq.core.tasks import (
    CANCELLED,
    FAILURE,
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
from tests.test_consumer_liveness import FakeClock


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


def test_a_task_gets_its_record_when_it_starts_and_keeps_its_result_across_a_reopen(tmp_path):
    store = TaskResults(str(tmp_path))
    assert store.get("t1") is None  # waiting in its queue: no record (PENDING)
    [started] = store.apply([("start", ("t1", "resize", 60))])
    assert (started.status, started.runs, started.name) == (STARTED, 1, "resize")
    assert store.apply([("finish", ("t1", "resize", 60, SUCCESS, {"pixels": [1, 2]}))]) == [None]
    store.close()
    again = TaskResults(str(tmp_path)).get("t1")
    assert (again.status, again.result, again.runs, again.name) == (
        SUCCESS,
        {"pixels": [1, 2]},
        1,
        "resize",
    )


def test_one_apply_answers_each_call_and_a_failed_call_writes_nothing(tmp_path):
    store = TaskResults(str(tmp_path))
    answers = store.apply(
        [
            ("start", ("a", "n", 60)),
            ("finish", ("a", "n", 60, SUCCESS, object())),  # not a msgpack value
            ("finish", ("b", "n", 60, STARTED)),  # not a final status
            ("drop_table", ()),
            ("start", ("a", "n", 60)),
        ]
    )
    assert answers[0].runs == 1 and answers[4].runs == 2
    assert isinstance(answers[1], TypeError) and "msgpack" in str(answers[1])
    assert isinstance(answers[2], ValueError) and "final" in str(answers[2])
    assert isinstance(answers[3], ValueError) and "drop_table" in str(answers[3])
    assert store.get("a").status == STARTED and store.get("b") is None


def test_a_failure_keeps_its_type_text_and_traceback_even_without_a_start(tmp_path):
    store = TaskResults(str(tmp_path))
    store.finish("t", "n", 60, FAILURE, None, "KeyError", "'x'", "Traceback ...")
    record = store.get("t")
    assert (record.status, record.runs, record.error_type, record.error, record.traceback) == (
        FAILURE,
        0,
        "KeyError",
        "'x'",
        "Traceback ...",
    )


def test_runs_count_every_start_and_an_ended_task_never_starts_again(tmp_path):
    store = TaskResults(str(tmp_path))
    assert [store.start("t", "n", 60).runs for _ in range(3)] == [1, 2, 3]
    store.finish("t", "n", 60, SUCCESS, 7)
    redelivered = store.start("t", "n", 60)
    assert (redelivered.status, redelivered.runs, redelivered.result) == (SUCCESS, 3, 7)


def test_only_a_task_not_started_can_be_cancelled(tmp_path):
    store = TaskResults(str(tmp_path))
    store.start("b", "n", 60)
    assert store.cancel("a", 60) is True
    assert store.cancel("a", 60) is False  # cancelled already
    assert store.cancel("b", 60) is False
    assert store.start("a", "n", 60).status == CANCELLED  # its delivery must not run it
    assert store.counts() == {CANCELLED: 1, FAILURE: 0, STARTED: 1, SUCCESS: 0}


def test_ended_tasks_expire_after_their_own_ttl_and_running_ones_never(tmp_path):
    clock = FakeClock()
    store = TaskResults(str(tmp_path), clock=clock)
    store.finish("short", "n", 10, SUCCESS, "short")
    store.finish("long", "n", 100, SUCCESS, "long")
    store.start("running", "n", 1)
    clock.now += 11
    assert store.apply([("expire", ())]) == [1]
    assert store.get("short") is None
    assert store.get("long").result == "long"
    clock.now += 1000
    assert store.expire() == 1
    assert store.get("running").status == STARTED


def test_a_damaged_store_file_raises_storage_error_naming_it(tmp_path):
    store = TaskResults(str(tmp_path))
    store.start("t", "n", 60)
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


def test_the_store_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        store = TaskResults(str(tmp_path / ".tasks"))
        store.start("t", "n", 60)
    finally:
        os.umask(old)
    assert os.stat(tmp_path / ".tasks").st_mode & 0o777 == 0o700
    for name in os.listdir(tmp_path / ".tasks"):  # the file, its -wal and -shm
        assert os.stat(tmp_path / ".tasks" / name).st_mode & 0o777 == 0o600, name


@pytest.fixture
def results_served(tmp_path):
    """A ``ResultsServer`` over a real ``TaskResults`` (its calls applied one at a time,
    as the actor's commits apply them), on an event loop of its own; a client of it."""
    import asyncio
    import threading

    from raymq.wire.blocking import BlockingClient
    from raymq.wire.results import PROTOCOL, ResultsServer

    store = TaskResults(str(tmp_path / "tasks"))
    loop = asyncio.new_event_loop()
    ready, out = threading.Event(), {}

    async def call(name, args):
        [answer] = store.apply([(name, args)])
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def run():
        asyncio.set_event_loop(loop)
        out["endpoint"] = loop.run_until_complete(ResultsServer(call).start("127.0.0.1"))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    client = BlockingClient(out["endpoint"], PROTOCOL, "task results")
    yield store, client
    client.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    store.close()


def test_a_tasks_start_and_finish_over_the_wire_are_the_stores(results_served):
    from raymq.wire.results import finish_args, start_record

    store, client = results_served
    started = start_record(client.call("start", ["t1", "add", 60.0]).value)
    assert (started.id, started.status, started.name, started.runs) == ("t1", STARTED, "add", 1)
    # Any msgpack value arrives as sent: a map with int keys, bytes, nesting.
    value = {1: [b"\x00", {"k": None}], "s": 2.5}
    assert client.call("finish", finish_args("t1", "add", 60.0, SUCCESS, value)).value is None
    done = store.get("t1")
    assert (done.status, done.result, done.runs) == (SUCCESS, value, 1)
    # Ended: a start (a redelivery) changes nothing and says so.
    again = start_record(client.call("start", ["t1", "add", 60.0]).value)
    assert (again.status, again.runs) == (SUCCESS, 1)
    # The store's own refusal comes back typed; the connection goes on.
    with pytest.raises(ValueError, match="final"):
        client.call("finish", finish_args("t2", "add", 60.0, STARTED))
    with pytest.raises(TypeError, match="task t3.*msgpack"):
        finish_args("t3", "add", 60.0, SUCCESS, object())
    assert client.broken is None and store.get("t2") is None
