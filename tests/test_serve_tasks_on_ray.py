"""Ray Serve task consumers on RayMQ (issue 29): Ray's own task-processor scenarios
(``python/ray/serve/tests/test_task_processor.py``, there on Celery's filesystem broker)
on ``raymq.serve.RayMQTaskProcessorAdapter``, plus a replica SIGKILLed mid-task."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import ray
from ray import serve
from ray.serve.schema import TaskProcessorConfig
from ray.serve.task_consumer import instantiate_adapter_from_config, task_consumer, task_handler
from raymq.actors.names import queue_actor_name

from raymq.core.tasks import CANCELLED, FAILURE, STARTED, SUCCESS
from raymq.errors import QueueNotFound
from raymq.serve import RayMQAdapterConfig, TaskFailed

pytestmark = pytest.mark.timeout(240)

MAX_RETRIES = 2
#: A replica stopping waits this little for requests (task consumers have none); its
#: running tasks are the adapter's to finish (``stop_consumer``).
QUICK_STOP = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 15}


@pytest.fixture(scope="module")
def serve_running(ray_session):
    """Serve on the session's Ray, for this module (no proxy: task consumers take no
    requests)."""
    serve.start(proxy_location="Disabled")
    yield serve
    serve.shutdown()


@pytest.fixture
def serve_on(serve_running):
    """Serve; the applications a test deployed are deleted after it (before its
    broker is shut down)."""
    yield serve_running
    for app in list(serve_running.status().applications):
        if app != SHARED_APP:
            serve_running.delete(app)


#: One deployment for the scenarios that need no set-up of their own (a deployment
#: takes some 5 s to start and 3 s to stop here).
SHARED_APP = "shared"


@pytest.fixture(scope="module")
def shared(serve_running, tmp_path_factory):
    """A broker of this module's own and the shared app on it: (broker, config, producer)."""
    import raymq

    paging = str(tmp_path_factory.mktemp("serve-paging"))
    broker = raymq.connect(namespace=f"raymq-serve-{uuid.uuid4().hex[:8]}", paging_directory=paging)
    config = processor_config(broker, queue_name())
    deploy(config, SHARED_APP)
    yield broker, config, instantiate_adapter_from_config(config)
    serve_running.delete(SHARED_APP)
    broker.shutdown()


def processor_config(broker, queue: str) -> TaskProcessorConfig:
    return TaskProcessorConfig(
        queue_name=queue,
        adapter="raymq.serve.RayMQTaskProcessorAdapter",
        adapter_config=RayMQAdapterConfig(
            namespace=broker.namespace, retry_delay_s=0.05, retry_backoff=1.0
        ),
        max_retries=MAX_RETRIES,
        failed_task_queue_name=f"{queue}.failed",
        unprocessable_task_queue_name=f"{queue}.unprocessable",
    )


def deploy(config: TaskProcessorConfig, app: str) -> None:
    """A task-consumer deployment of one replica taking tasks from ``config``'s queue."""

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2, **QUICK_STOP)
    @task_consumer(task_processor_config=config)
    class Worker:
        @task_handler(name="add")
        def add(self, a, b):
            return {"sum": a + b, "pid": os.getpid()}

        @task_handler(name="spares")
        def spares(self):
            from raymq.placement import spares

            return spares.kept()

        @task_handler(name="boom")
        def boom(self):
            raise KeyError("boom")

        @task_handler(name="hold")
        def hold(self, pid_file, seconds):
            return hold(pid_file, seconds)

        @task_handler(name="gated")
        def gated(self, pid_file, gate):
            with open(pid_file, "w") as f:
                f.write(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.02)
            return os.getpid()

    serve.run(Worker.bind(), name=app, route_prefix=None)


def hold(pid_file: str, seconds: float) -> int:
    """The "hold" task: write this replica's pid to ``pid_file``, sleep, return the pid."""
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return os.getpid()


def wait_for(what, condition, timeout: float = 60.0):
    """Poll ``condition`` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def status_of(producer, task_id, wanted):
    def check():
        result = producer.get_task_status_sync(task_id)
        return result if result.status == wanted else None

    return wait_for(f"task {task_id} {wanted}", check)


def dead_letters(broker, queue: str) -> list:
    """The messages of dead-letter queue ``queue`` (none before its first)."""
    try:
        return list(broker.get_queue(queue).browse())
    except QueueNotFound:
        return []


def queue_name() -> str:
    return f"tasks-{uuid.uuid4().hex[:6]}"


def test_a_task_reaches_the_deployment_and_its_result_is_stored(shared):
    broker, config, producer = shared
    before = producer.get_metrics_sync()
    sent = producer.enqueue_task_sync("add", args=[2], kwargs={"b": 3})
    assert sent.status == "PENDING"
    done = status_of(producer, sent.id, SUCCESS)
    assert done.result["sum"] == 5 and done.result["pid"] != os.getpid()
    # On the store's node (one node here), statuses are read from its file.
    after = producer.get_metrics_sync()
    assert after["status_reads_local"] > before["status_reads_local"]
    assert after["status_read_failures"] == 0
    record = ray.get(broker.task_results().get.remote(sent.id))
    assert record.runs == 1
    # Its start and finish came over the wire's results protocol, not as Ray calls.
    assert ray.get(broker.task_results().counts.remote())["wire_calls"] >= 2
    wait_for("queue drained", lambda: broker.get_queue(config.queue_name).stats()["depth"] == 0)


def test_a_replica_keeps_no_warm_spare_target_list(shared):
    """A replica makes one consumer (its TargetList, made when it starts): a warm spare
    beside it would be an idle Ray worker per replica, ~0.6 % of a core each."""
    producer = shared[2]
    # (A spare is kept, or its creation put off, from the moment a consumer starts.)
    done = status_of(producer, producer.enqueue_task_sync("spares").id, SUCCESS)
    assert done.result == []


def test_a_failing_task_runs_one_plus_max_retries_times_then_is_dead_lettered(shared):
    broker, config, producer = shared
    sent = producer.enqueue_task_sync("boom")
    failed = status_of(producer, sent.id, FAILURE)
    assert isinstance(failed.result, TaskFailed)
    assert failed.result.error_type == "KeyError" and "boom" in failed.result.traceback
    assert ray.get(broker.task_results().get.remote(sent.id)).runs == 1 + MAX_RETRIES
    dead = wait_for(
        "the failed-task queue holds it",
        lambda: dead_letters(broker, config.failed_task_queue_name),
    )
    assert len(dead) == 1
    props = dead[0].properties
    assert props["RayMQTaskId"] == sent.id and props["RayMQTaskName"] == "boom"
    assert props["RayMQExceptionType"] == "KeyError"
    assert props["RayMQDeadLetterReason"] == "failed"
    assert "raise KeyError" in props["RayMQTraceback"]


def test_an_unknown_task_lands_in_the_unprocessable_queue(shared):
    broker, config, producer = shared
    sent = producer.enqueue_task_sync("no_such_task", args=[1])
    failed = status_of(producer, sent.id, FAILURE)
    assert failed.result.error_type == "LookupError"
    dead = [
        m
        for m in dead_letters(broker, config.unprocessable_task_queue_name)
        if m.properties.get("RayMQTaskId") == sent.id
    ]
    assert len(dead) == 1 and dead[0].properties["RayMQDeadLetterReason"] == "unknown task"
    # and a body that is no task at all: there too, never nowhere
    broker.get_queue(config.queue_name).send(b"\xc1 not a task")
    wait_for(
        "the undecodable one too",
        lambda: any(
            m.properties["RayMQDeadLetterReason"] == "undecodable"
            for m in dead_letters(broker, config.unprocessable_task_queue_name)
        ),
    )


def test_a_task_cancelled_before_it_started_never_runs(broker, serve_on):
    config = processor_config(broker, queue_name())
    producer = instantiate_adapter_from_config(config)
    cancelled = producer.enqueue_task_sync("add", args=[1, 1])
    assert producer.cancel_task_sync(cancelled.id) is True
    kept = producer.enqueue_task_sync("add", args=[2, 2])
    deploy(config, "cancelling")
    assert status_of(producer, kept.id, SUCCESS).result["sum"] == 4
    wait_for("queue drained", lambda: broker.get_queue(config.queue_name).stats()["depth"] == 0)
    record = ray.get(broker.task_results().get.remote(cancelled.id))
    assert (record.status, record.runs) == (CANCELLED, 0)
    assert producer.cancel_task_sync(kept.id) is False  # ended already


def test_a_task_whose_replica_is_killed_runs_again_on_the_next(broker, serve_on, tmp_path):
    config = processor_config(broker, queue_name())
    deploy(config, "killed")
    producer = instantiate_adapter_from_config(config)
    pid_file, gate = str(tmp_path / "pid"), tmp_path / "gate"
    # Gated, not timed: the first run cannot end before the kill, however slow the machine.
    sent = producer.enqueue_task_sync("gated", args=[pid_file, str(gate)])
    status_of(producer, sent.id, STARTED)
    pid_path = tmp_path / "pid"
    first = int(wait_for("the handler's pid", lambda: pid_path.exists() and pid_path.read_text()))
    pid_path.unlink()
    os.kill(first, signal.SIGKILL)
    gate.touch()  # the run again goes through at once
    done = status_of(producer, sent.id, SUCCESS)
    assert done.result != first
    assert ray.get(broker.task_results().get.remote(sent.id)).runs == 2


def test_the_producer_reports_metrics_and_health(shared):
    broker = shared[0]
    config = processor_config(broker, queue_name())  # a queue nobody consumes
    producer = instantiate_adapter_from_config(config)
    producer.enqueue_task_sync("add", args=[1, 2])
    metrics = producer.get_metrics_sync()
    assert metrics["depth"] == 1  # waiting: PENDING, and not in the result store
    # (the broker's store: the other tests' tasks are in it too)
    assert {"STARTED", "SUCCESS", "FAILURE", "CANCELLED", "commits"} <= set(metrics["tasks"])
    assert metrics["dead_letters"] == {
        config.failed_task_queue_name: 0,
        config.unprocessable_task_queue_name: 0,
    }
    [(who, health)] = producer.health_check_sync()[0].items()
    assert who.startswith("raymq@") and health["ok"] == "down"  # it consumes nothing


def running_replicas(app: str) -> int:
    status = serve.status().applications.get(app)
    if status is None:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values())


def test_a_task_consumer_scales_up_on_its_backlog_and_back_to_zero(broker, serve_on, tmp_path):
    config = processor_config(broker, queue_name())
    producer = instantiate_adapter_from_config(config)  # (creates the queue)

    @serve.deployment(
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=2,  # two handler threads a replica
        autoscaling_config={
            "min_replicas": 0,
            "initial_replicas": 0,
            "max_replicas": 3,
            "upscale_delay_s": 0,
            "downscale_delay_s": 1,
            "downscale_to_zero_delay_s": 1,
            "policy": {
                "policy_function": "raymq.serve:BacklogAutoscalingPolicy",
                "policy_kwargs": {
                    "queue": config.queue_name,
                    "target_backlog_per_replica": 2,
                    "namespace": broker.namespace,
                    "poll_interval_s": 0.2,
                },
            },
        },
    )
    @task_consumer(task_processor_config=config)
    class Scaled:
        @task_handler(name="hold")
        def hold(self, pid_file, seconds):
            return hold(pid_file, seconds)

    serve.run(Scaled.bind(), name="scaled", route_prefix=None)
    assert running_replicas("scaled") == 0
    sent = [
        producer.enqueue_task_sync("hold", args=[str(tmp_path / f"pid{i}"), 3.0]) for i in range(6)
    ]
    wait_for("three replicas for six tasks", lambda: running_replicas("scaled") == 3)
    pids = {status_of(producer, t.id, SUCCESS).result for t in sent}
    assert len(pids) >= 2  # the tasks ran on several replicas
    wait_for("scaled back to zero", lambda: running_replicas("scaled") == 0)


def test_twenty_tasks_survive_a_redeploy_and_each_runs_once(broker, serve_on, tmp_path):
    config = processor_config(broker, queue_name())
    deploy(config, "redeployed")
    producer = instantiate_adapter_from_config(config)
    gate = tmp_path / "gate"
    sent = [
        producer.enqueue_task_sync("gated", args=[str(tmp_path / f"{i}.pid"), str(gate)])
        for i in range(20)
    ]

    def pids_seen() -> set[str]:
        return {p.read_text() for p in tmp_path.glob("*.pid")} - {""}

    # The old replica's two handler threads hold a task each until the gate opens;
    # the new code's replica comes up beside it and starts two of the others.
    old = wait_for("the old replica's tasks started", lambda: pids_seen())
    redeploy = threading.Thread(target=deploy, args=(config, "redeployed"))
    redeploy.start()
    wait_for("the new replica's tasks started", lambda: pids_seen() - old)
    gate.touch()
    redeploy.join(120)
    pids = {status_of(producer, t.id, SUCCESS).result for t in sent}
    assert len(pids) == 2
    runs = [ray.get(broker.task_results().get.remote(t.id)).runs for t in sent]
    assert runs == [1] * 20


def test_tasks_go_on_after_the_queue_actor_is_killed(shared):
    broker, config, producer = shared
    before = producer.enqueue_task_sync("add", args=[1, 2])
    status_of(producer, before.id, SUCCESS)
    actor = ray.get_actor(queue_actor_name(config.queue_name), namespace=broker.namespace)
    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)  # Ray restarts it in place
    after = [producer.enqueue_task_sync("add", args=[i, i]) for i in range(5)]
    assert [status_of(producer, t.id, SUCCESS).result["sum"] for t in after] == [0, 2, 4, 6, 8]


def test_results_outlive_their_store_actor_which_is_found_again(shared):
    broker, config, producer = shared
    sent = producer.enqueue_task_sync("add", args=[20, 22])
    assert status_of(producer, sent.id, SUCCESS).result["sum"] == 42
    ray.kill(broker.task_results(), no_restart=True)  # ended, as by a broker's stop
    # The producer's handle is dead; it asks the broker again, which starts the store
    # over the same file. (A status is read from the file itself on this node.)
    assert producer.get_metrics_sync()["tasks"]["SUCCESS"] >= 1
    again = producer.get_task_status_sync(sent.id)
    assert (again.status, again.result["sum"]) == (SUCCESS, 42)
    later = producer.enqueue_task_sync("add", args=[1, 1])  # and the replica's too
    assert status_of(producer, later.id, SUCCESS).result["sum"] == 2
    # Its broken results connection went through Ray meanwhile, then connects again
    # (within WIRE_RETRY_SECONDS of the break) to the new store.

    def over_the_wire_again():
        task = producer.enqueue_task_sync("add", args=[2, 2])
        assert status_of(producer, task.id, SUCCESS).result["sum"] == 4
        return ray.get(broker.task_results().counts.remote())["wire_calls"] > 0

    wait_for("the replica's results connection again", over_the_wire_again)


@pytest.mark.parametrize(
    "settings, error, words",
    [
        ({"result_ttl_s": -1}, "InvalidSetting", "result_ttl_s"),
        ({"retry_backoff": 0.5}, "InvalidSetting", "retry_backoff"),
        ({"retry_dealy_s": 1}, "ValidationError", "retry_dealy_s"),  # misspelt: refused
        ("redis://localhost", "TypeError", "RayMQAdapterConfig"),
    ],
)
def test_bad_adapter_settings_are_refused_by_name(settings, error, words):
    from raymq.serve import RayMQTaskProcessorAdapter

    config = TaskProcessorConfig(queue_name="q", adapter_config=settings)
    with pytest.raises(Exception) as raised:
        RayMQTaskProcessorAdapter(config)
    assert type(raised.value).__name__ == error and words in str(raised.value)
