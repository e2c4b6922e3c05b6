"""The QueueArea's storage: segment (page) files, the ack log and checkpoints.

Plain Python, no Ray: the queue actor wraps it. docs/FORMAT.md describes the bytes;
``log.py`` says which module owns which concept.
"""

from raymq.storage.files import create_queue_directory, write_file_atomic
from raymq.storage.log import RecoveryReport, SegmentLog
from raymq.storage.writer import PreparedWrite

__all__ = [
    "PreparedWrite",
    "RecoveryReport",
    "SegmentLog",
    "create_queue_directory",
    "write_file_atomic",
]
