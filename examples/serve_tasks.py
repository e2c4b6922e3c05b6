"""Ray Serve task consumers on RayMQ: a deployment that takes tasks from a queue, scaled
on its backlog, with retries, dead letters and stored results; nothing beside Ray.

A ``@task_consumer`` deployment gets its tasks through ``raymq.serve``'s adapter; a
producer (here this script) enqueues them with the same ``TaskProcessorConfig`` and asks
for their results. One task fails on purpose: it runs ``1 + max_retries`` times, then
lands in the failed-task queue with its exception and traceback.

``python examples/serve_tasks.py`` runs it on an embedded local Ray of its own;
``ray job submit --working-dir examples -- python serve_tasks.py`` (or ``--join``) joins
the running broker, leaves its queues ``example.tasks`` (drained) and
``example.tasks.failed`` (the failed task) there, and deletes its Serve application.
"""

from __future__ import annotations

import time

from _common import example_broker
from ray import serve
from ray.serve.schema import TaskProcessorConfig
from ray.serve.task_consumer import instantiate_adapter_from_config, task_consumer, task_handler

from raymq.serve import RayMQAdapterConfig

APP = "example-tasks"
TASKS = 40


def build(config: TaskProcessorConfig):
    """The task-consumer deployment: 1 to 2 replicas of 4 handler threads each."""

    @serve.deployment(
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4,
        autoscaling_config={
            "min_replicas": 1,
            "max_replicas": 2,
            "upscale_delay_s": 0,
            "downscale_delay_s": 5,
            "policy": {
                "policy_function": "raymq.serve:BacklogAutoscalingPolicy",
                "policy_kwargs": {
                    "queue": config.queue_name,
                    "target_backlog_per_replica": 8,
                    "namespace": config.adapter_config.namespace,
                },
            },
        },
    )
    @task_consumer(task_processor_config=config)
    class Thumbnails:
        @task_handler(name="thumbnail")
        def thumbnail(self, width: int, height: int) -> dict:
            time.sleep(0.05)  # the work
            return {"width": width // 4, "height": height // 4}

        @task_handler(name="corrupt")
        def corrupt(self, path: str) -> None:
            raise ValueError(f"cannot decode {path}")

    return Thumbnails.bind()


def main() -> None:
    with example_broker("serve-tasks") as example:
        config = TaskProcessorConfig(
            queue_name="example.tasks",
            adapter="raymq.serve.RayMQTaskProcessorAdapter",
            adapter_config=RayMQAdapterConfig(
                namespace=example.broker.namespace, retry_delay_s=0.1
            ),
            max_retries=2,
            failed_task_queue_name="example.tasks.failed",
        )
        producer = instantiate_adapter_from_config(config)
        serve.start(proxy_location="Disabled")  # task consumers take no HTTP requests
        serve.run(build(config), name=APP, route_prefix=None)
        try:
            t0 = time.monotonic()
            tasks = [
                producer.enqueue_task_sync("thumbnail", args=[640 + i, 480]) for i in range(TASKS)
            ]
            bad = producer.enqueue_task_sync("corrupt", args=["cat.png"])
            print(f"enqueued {TASKS} thumbnail tasks and one that fails")
            results = [wait(producer, t.id, "SUCCESS") for t in tasks]
            print(
                f"{TASKS} tasks SUCCESS in {time.monotonic() - t0:.1f} s;"
                f" first result {results[0].result}"
            )
            failed = wait(producer, bad.id, "FAILURE")
            print(f"the corrupt one: FAILURE after 3 runs: {failed.result}")
            dead = list(example.broker.get_queue("example.tasks.failed").browse())
            print(
                f"example.tasks.failed holds {len(dead)} dead letter(s), reason"
                f" {dead[-1].properties['RayMQDeadLetterReason']!r}"
            )
            metrics = producer.get_metrics_sync()
            statuses = {k: v for k, v in metrics["tasks"].items() if k.isupper()}
            print(f"queue depth {metrics['depth']}, tasks by status {statuses}")
        finally:
            serve.delete(APP)


def wait(producer, task_id: str, status: str, timeout: float = 120.0):
    """The task's result once it has ``status`` (``TimeoutError`` after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = producer.get_task_status_sync(task_id)
        if result.status == status:
            return result
        time.sleep(0.05)
    raise TimeoutError(f"task {task_id} not {status} in {timeout} s: {result.status}")


if __name__ == "__main__":
    main()
