"""RayMQ for Ray Serve: the broker of ``@task_consumer`` deployments.

    from ray.serve.schema import TaskProcessorConfig
    from raymq.serve import RayMQAdapterConfig

    config = TaskProcessorConfig(
        queue_name="jobs",
        adapter="raymq.serve.RayMQTaskProcessorAdapter",
        adapter_config=RayMQAdapterConfig(),
    )

Needs ``ray[serve]`` (a dependency of RayMQ).
"""

from raymq.serve.adapter import (
    RayMQAdapterConfig,
    RayMQTaskProcessorAdapter,
    TaskCounts,
    TaskFailed,
)
from raymq.serve.autoscaling import BacklogAutoscalingPolicy

__all__ = [
    "BacklogAutoscalingPolicy",
    "RayMQAdapterConfig",
    "RayMQTaskProcessorAdapter",
    "TaskCounts",
    "TaskFailed",
]
