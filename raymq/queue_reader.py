"""QueueReader: a queue read by Ray Data in parallel, acknowledged only on ``commit()``.

``QueueReader(queue).dataset()`` leases what the queue holds (up to ``max_messages``,
matching ``selector``): the queue holds those messages for the reader as it holds a
consumer's deliveries, so no other consumer gets them, but nothing is read yet and
nothing is acknowledged. Only their offsets come to the driver. The dataset's read
tasks (``ray.data.read_datasource``) read offset ranges from the queue actor in
parallel, one Arrow block per ``batch_rows`` messages (columns as
``raymq.data.delivery_to_table``), and tell the reader's ``ReadLeaseActor`` which
offsets they read.

``commit()`` acknowledges exactly the offsets read and gives back the rest; ``abort()``
gives everything back (no delivery counted). The lease actor belongs to the driver: if
the driver dies before either, Ray ends it, the queue sees it die (as it sees a
TargetList die) and delivers everything again. So a pipeline
``QueueReader -> map_batches -> QueueDatasink`` that fails anywhere loses nothing;
run again, with the sink's message ids, it stores each row once.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import ray
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from raymq.arrow_messages import (
    DEFAULT_BATCH_ROWS,
    conform,
    delivery_to_table,
    progress_bar,
    resolve_queue,
    unify_schemas,
)
from raymq.client import Broker, Queue
from raymq.client.calls import _call
from raymq.errors import ConsumerClosed, InvalidSetting

#: Offsets leased per call to the queue actor: bounds one call's time and answer.
LEASE_CHUNK = 200_000
#: Offsets acknowledged per call (as ``Drained.ack``: one call for millions of offsets
#: would hold the queue actor for seconds).
ACK_CHUNK = 100_000


class QueueReader:
    """Lease a queue's messages for a Ray Dataset; ``commit()`` or ``abort()`` after.

    Also a context manager: leaving the block without ``commit()`` aborts.
    """

    def __init__(
        self,
        queue: Queue | str,
        *,
        selector: str | None = None,
        max_messages: int | None = None,
        broker: Broker | None = None,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        headers: bool = True,
        progress: bool = True,
        timeout: float = 0.0,
    ) -> None:
        """``queue``: a handle, or a name with ``broker=``. ``selector``: a JMS selector
        over the properties; ``max_messages``: most messages leased (None: all there
        are when ``dataset()`` is called; a selector's reader first scans the stored
        properties, however long that takes). ``timeout``: when the queue has nothing
        for the reader, seconds to wait for a first message. ``batch_rows``: messages
        per block; ``headers`` False leaves out the offset and timestamp columns."""
        if max_messages is not None and (
            isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1
        ):
            raise InvalidSetting(f"max_messages={max_messages!r} must be None or an int >= 1")
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
            raise InvalidSetting(f"batch_rows={batch_rows!r} must be an int >= 1")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
            raise InvalidSetting(f"timeout={timeout!r} must be a number of seconds >= 0")
        self.timeout = float(timeout)
        self.queue = resolve_queue(queue, broker)
        self.selector = selector
        self.max_messages = max_messages
        self.batch_rows = batch_rows
        self.headers = headers
        self.progress = progress
        #: This reader's consumer id at the queue (hex, as every consumer id).
        self.consumer_id = uuid.uuid4().hex
        self._subscription: str | None = getattr(self.queue, "subscription_name", None)
        self._lease = None  # its ReadLeaseActor, once leased
        self._offsets: np.ndarray | None = None
        self._ended: str | None = None  # "committed" or "aborted"

    def __repr__(self) -> str:
        n = "-" if self._offsets is None else len(self._offsets)
        return f"QueueReader({self.queue.name!r}, leased={n}, {self._ended or 'open'})"

    def __enter__(self) -> QueueReader:
        return self

    def __exit__(self, *exc) -> None:
        if self._ended is None:
            self.abort()

    @property
    def leased(self) -> int:
        """Messages this reader holds (0 before ``dataset()``)."""
        return 0 if self._offsets is None else len(self._offsets)

    def _check_open(self) -> None:
        if self._ended is not None:
            raise ConsumerClosed(f"reader of queue {self.queue.name!r} was {self._ended}")

    def dataset(self, *, parallelism: int = -1) -> ray.data.Dataset:
        """A Dataset of the leased messages (leased at the first call; the same ones
        after). Its read tasks read them from the queue in parallel, one block of
        ``batch_rows`` messages each (``parallelism``: that many tasks instead); nothing
        is acknowledged until ``commit()``."""
        self._check_open()
        if self._offsets is None:
            self._take_lease()
        source = LeasedDatasource(self)
        if parallelism < 1:
            # Asked for nothing, Ray Data wants at least 200 blocks and splits fewer
            # tasks' output into 500-row slivers: 100,000 messages became 200 blocks
            # (and 200 Spark partitions in read_queue, ~10 s more than 2).
            parallelism = max(1, -(-len(self._offsets) // self.batch_rows))
        return ray.data.read_datasource(source, override_num_blocks=parallelism)

    def _take_lease(self) -> None:
        from raymq.actors.read_lease_actor import ReadLeaseActor

        self._lease = ReadLeaseActor.remote()  # owned by this driver: ends with it
        taken: list[np.ndarray] = []
        try:
            self._lease_into(taken)
        except BaseException:
            # What was leased goes back now, not when this driver ends.
            with contextlib.suppress(Exception):
                self._end("aborted", np.concatenate(taken) if taken else None)
            raise
        self._offsets = np.sort(np.concatenate(taken)) if taken else np.zeros(0, np.int64)

    def _lease_into(self, taken: list[np.ndarray]) -> None:
        """Lease in chunks into ``taken`` until the queue has no more for the reader
        (or ``max_messages``), waiting up to ``timeout`` for a first message."""
        n, more = 0, True
        total = self.max_messages
        deadline = time.monotonic() + self.timeout
        with progress_bar(f"leasing {self.queue.name}", total, self.progress) as bar:
            while more and (total is None or n < total):
                want = LEASE_CHUNK if total is None else min(LEASE_CHUNK, total - n)
                wait = max(0.0, deadline - time.monotonic()) if n == 0 else 0.0
                offsets, more = self.queue._invoke(
                    "lease",
                    self.consumer_id,
                    want,
                    self.selector,
                    self._lease,
                    self._subscription,
                    wait,
                )
                if len(offsets):
                    taken.append(offsets)
                    n += len(offsets)
                    bar.advance(len(offsets))
                elif n == 0 and time.monotonic() < deadline:
                    more = True  # the queue waits at most a second per call: ask again
            bar.set_total(n)

    def commit(self) -> int:
        """Acknowledge every message the dataset's read tasks read, give back the
        rest; returns how many were acknowledged. Ends the reader."""
        self._check_open()
        read = (
            np.zeros(0, np.int64)
            if self._lease is None
            else ray.get(self._lease.read_offsets.remote())
        )
        acked = 0
        for start in range(0, len(read), ACK_CHUNK):
            acked += self.queue._invoke(
                "ack", self.consumer_id, read[start : start + ACK_CHUNK], self._subscription
            )
        unread = self._offsets if self._offsets is not None else np.zeros(0, np.int64)
        self._end("committed", unread[~np.isin(unread, read)])
        return acked

    def abort(self) -> int:
        """Give back everything leased (their delivery not counted); returns how many.
        Ends the reader."""
        self._check_open()
        leased = self._offsets if self._offsets is not None else np.zeros(0, np.int64)
        self._end("aborted", leased)
        return len(leased)

    def _end(self, how: str, give_back: np.ndarray | None) -> None:
        self._ended = how
        if self._lease is None:
            return
        try:
            self.queue._invoke("close_consumer", self.consumer_id, give_back, self._subscription)
        finally:
            lease, self._lease = self._lease, None
            ray.get(lease.close.remote())
            ray.kill(lease)


class LeasedDatasource(Datasource):
    """The Ray Data source of a ``QueueReader``: read tasks over its leased offsets."""

    def __init__(self, reader: QueueReader) -> None:
        super().__init__()
        self._name = reader.queue.name
        self._offsets = reader._offsets if reader._offsets is not None else np.zeros(0, np.int64)
        self._args = _ReadArgs(
            reader.queue._actor,
            reader.queue.name,
            reader.consumer_id,
            reader._subscription,
            reader._lease,
            reader.batch_rows,
            reader.headers,
        )

    def get_name(self) -> str:
        """The name Ray Data shows for the read (``RayMQ(queue)``)."""
        return f"RayMQ({self._name})"

    def estimate_inmemory_data_size(self) -> int | None:
        """Unknown without reading the messages."""
        return None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit=None, data_context=None
    ) -> list[ReadTask]:
        """One task per share of the offsets (at most ``parallelism``, at least one
        block's worth each); each yields blocks of ``batch_rows`` messages."""
        n = len(self._offsets)
        if n == 0:
            return []
        tasks = max(1, min(parallelism, -(-n // self._args.batch_rows)))
        out = []
        for part in np.array_split(self._offsets, tasks):
            if not len(part):
                continue
            meta = BlockMetadata(
                num_rows=len(part), size_bytes=None, exec_stats=None, input_files=None
            )
            out.append(
                ReadTask(_reader_of(part, self._args), meta, per_task_row_limit=per_task_row_limit)
            )
        return out


class _ReadArgs:
    """What a read task needs (pickled into it)."""

    def __init__(
        self,
        actor,
        queue: str,
        consumer_id: str,
        subscription,
        lease,
        batch_rows: int,
        headers: bool,
    ):
        self.actor = actor
        self.queue = queue
        self.consumer_id = consumer_id
        self.subscription = subscription
        self.lease = lease
        self.batch_rows = batch_rows
        self.headers = headers


def _reader_of(offsets: np.ndarray, args: _ReadArgs):
    def read() -> Iterator[pa.Table]:
        for start in range(0, len(offsets), args.batch_rows):
            part = offsets[start : start + args.batch_rows]
            batch = _call(args.actor.read_leased, args.consumer_id, part, args.subscription)
            # Reported before the block is used: commit acknowledges what was read.
            ray.get(args.lease.read.remote(part))
            yield delivery_to_table(batch, headers=args.headers)

    return read


# -- a queue's messages as blocks of one schema (read_queue, raymq.spark) -------------


@dataclass
class LeasedBlocks:
    """What ``leased_blocks`` read: Arrow blocks of one schema in the object store (the
    driver holds references only), of messages ``reader`` leased and not yet
    acknowledged."""

    reader: QueueReader
    refs: list[ray.ObjectRef]
    schema: pa.Schema


@ray.remote(num_cpus=0)
def _schema_of(table: pa.Table) -> pa.Schema:
    return table.schema


@ray.remote(num_cpus=0)
def _conformed(table: pa.Table, schema: pa.Schema) -> pa.Table:
    return conform(table, schema)


@contextlib.contextmanager
def leased_blocks(reader: QueueReader) -> Iterator[LeasedBlocks]:
    """Read everything ``reader`` leases into object-store blocks with one schema (the
    blocks' own, unified: a property whose type differs between blocks takes the
    wider one, see ``raymq.data.unify_schemas``; blocks that differ are rewritten in
    tasks beside them). The caller commits once what it built is safe; leaving the
    block without a commit aborts (everything is delivered again)."""
    with reader:
        ds = reader.dataset().materialize()
        refs = list(ds.to_arrow_refs())
        if refs:
            schemas = ray.get([_schema_of.remote(r) for r in refs])
            schema = unify_schemas(schemas)
            refs = [
                r if s == schema else _conformed.remote(r, schema)
                for r, s in zip(refs, schemas, strict=True)
            ]
        else:
            schema = delivery_to_table(pa.table({}), headers=reader.headers).schema
        yield LeasedBlocks(reader, refs, schema)
