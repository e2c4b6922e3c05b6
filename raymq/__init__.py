"""RayMQ: a durable message broker on Ray whose queues hold backlogs larger than memory."""

from raymq import errors
from raymq.client import Broker, Consumer, Message, Queue, connect

__all__ = ["Broker", "Consumer", "Message", "Queue", "connect", "errors"]
__version__ = "0.1.0"
