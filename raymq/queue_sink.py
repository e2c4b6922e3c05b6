"""QueueDatasink: a Ray Dataset written into a queue, each row stored once.

``dataset.write_datasink(QueueDatasink(queue))``: every row becomes a message (the
``body`` column its body, the other columns its properties). Ray Data retries a write
task that failed, and a pipeline run again writes its rows again, so every message
carries a producer id (``_AMQ_DUPL_ID``, see ``raymq.core.duplicate_ids``) and the
queue stores a message whose id it stored within its ``dedup_window_s`` only once:

- with ``id_column``, a row's id is ``id_prefix`` + that column's value: the same
  across runs (``offset``, when the rows come from a ``QueueReader`` and keep it);
- without, it is this sink's write id, the write task's index, and the row's place in
  its task: the same when Ray Data retries the task, new for a new sink.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import pyarrow as pa
from ray.data.block import Block, BlockAccessor
from ray.data.datasource import Datasink
from ray.data.datasource.datasink import WriteResult

from raymq.arrow_messages import encode_arrow, resolve_queue
from raymq.client import Broker, Queue
from raymq.client.calls import _call
from raymq.core.duplicate_ids import DUPLICATE_ID_PROPERTY
from raymq.errors import InvalidSetting

#: Rows per send (one write and one fsync each), as ``raymq.spark``'s.
SEND_ROWS = 10_000
#: Columns a ``QueueReader`` adds that are the source message's, not the row's: left
#: out of the properties (the queue sets its own offset and timestamp).
SOURCE_COLUMNS = ("offset", "timestamp")


class QueueDatasink(Datasink[int]):
    """Writes a Dataset's rows into a queue, each row once (see the module)."""

    def __init__(
        self,
        queue: Queue | str,
        *,
        broker: Broker | None = None,
        body_column: str = "body",
        id_column: str | None = None,
        id_prefix: str = "",
        timeout: float | None = None,
    ) -> None:
        """``queue``: a handle, or a name with ``broker=``. ``body_column``: the
        bodies (bytes). ``id_column``/``id_prefix``: where row ids come from (see the
        module). ``timeout``: seconds a send may wait at a BLOCKing ``max_size_bytes``."""
        q = resolve_queue(queue, broker)
        self.queue_name = q.name
        self._actor = q._actor
        self._max_message_size = q.broker.config.max_message_size
        self.body_column = body_column
        self.id_column = id_column
        self.id_prefix = id_prefix
        self.timeout = timeout
        self.write_id = uuid.uuid4().hex
        #: Rows written (stored, or found stored already), once the write completed.
        self.rows_written = 0

    def get_name(self) -> str:
        """The name Ray Data shows for the write."""
        return f"RayMQ({self.queue_name})"

    def write(self, blocks: Iterable[Block], ctx) -> int:
        """Send one write task's blocks; returns the rows sent."""
        rows = 0
        for b, block in enumerate(blocks):
            table = BlockAccessor.for_block(block).to_arrow()
            for start in range(0, table.num_rows, SEND_ROWS):
                part = table.slice(start, SEND_ROWS)
                ids = self._ids(part, f"{ctx.task_idx}:{b}:{start}")
                messages = encode_arrow(
                    self._message_columns(part).append_column(
                        DUPLICATE_ID_PROPERTY, pa.array(ids, pa.string())
                    ),
                    max_message_size=self._max_message_size,
                    queue=self.queue_name,
                )
                _call(self._actor.send_batch_ids, messages, ids, self.timeout)
                rows += part.num_rows
        return rows

    def _ids(self, part: pa.Table, where: str) -> list[str]:
        if self.id_column is None:
            return [f"{self.id_prefix}{self.write_id}:{where}:{i}" for i in range(part.num_rows)]
        if self.id_column not in part.column_names:
            raise InvalidSetting(
                f"id_column={self.id_column!r} for queue {self.queue_name!r} is not a column"
                f" of the dataset ({', '.join(part.column_names)})"
            )
        values = part.column(self.id_column).to_pylist()
        if any(v is None for v in values):
            raise InvalidSetting(
                f"id_column={self.id_column!r} for queue {self.queue_name!r} has nulls:"
                " every row needs an id"
            )
        return [f"{self.id_prefix}{v}" for v in values]

    def _message_columns(self, part: pa.Table) -> pa.Table:
        if self.body_column not in part.column_names:
            raise InvalidSetting(
                f"body_column={self.body_column!r} for queue {self.queue_name!r} is not a"
                f" column of the dataset ({', '.join(part.column_names)})"
            )
        drop = [c for c in (*SOURCE_COLUMNS, DUPLICATE_ID_PROPERTY) if c in part.column_names]
        drop = [c for c in drop if c != self.body_column]
        part = part.drop_columns(drop)
        if self.body_column != "body":
            names = ["body" if c == self.body_column else c for c in part.column_names]
            part = part.rename_columns(names)
        return part

    def on_write_complete(self, write_result: WriteResult[int]) -> None:
        """Counts the rows written (``rows_written``)."""
        self.rows_written = sum(write_result.write_returns)
