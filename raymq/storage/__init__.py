"""The QueueArea's storage: segment (page) files, the ack log and checkpoints.

Plain Python, no Ray: the queue actor wraps it. docs/FORMAT.md describes the bytes.
"""

from raymq.storage.log import RecoveryReport, SegmentLog

__all__ = ["RecoveryReport", "SegmentLog"]
