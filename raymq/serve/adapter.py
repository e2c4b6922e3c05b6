"""RayMQ as the broker of Ray Serve's task consumers (``@task_consumer``).

``TaskProcessorConfig(queue_name=..., adapter="raymq.serve.RayMQTaskProcessorAdapter",
adapter_config=RayMQAdapterConfig())`` makes a deployment's replicas take tasks from the
RayMQ queue ``queue_name`` of the running broker. Each replica runs
``consumer_concurrency`` handler threads over one consumer whose prefetch is that many
(times ``prefetch_multiplier``; with more than 1, outcomes are stored and tasks
acknowledged by completion threads while the handler threads go on). A task's start
and finish reach the result store over the wire's results protocol
(``raymq.wire.results``), a tenth of a Ray call's CPU; through Ray when that connection
is broken, the threads' calls sharing actor calls (``raymq.core.call_batcher``). A task is
acknowledged after its handler returned and its outcome is on disk, so a
replica that dies mid-task has it delivered again to another (RayMQ never times a task
out, however long it runs). Statuses and results are kept by the broker's
``TaskResultsActor`` (a SQLite file in the paging directory), so they outlive replicas
and the broker.

A handler that raises runs again after ``retry_delay_s * retry_backoff**n`` seconds (at
most ``max_retry_delay_s``), up to ``max_retries`` times: the task is nacked with that
delay (``Consumer.nack(delay=)``), so the wait holds no handler thread and no prefetch
slot, survives a restart of the queue, and the retry may run on any replica. A task is
enqueued with its id as its message id, so a send the client repeats (a broken
channel) stores it once. Its runs are counted in the store, so redeliveries count
too: a task whose replica died on each of its ``1 + max_retries`` runs fails without
another. A task that fails for
good goes to ``failed_task_queue_name``, one with an unknown name or an undecodable
body to ``unprocessable_task_queue_name``; either name None means the queue's dead-letter
queue (``f"{queue_name}.DLQ"``), never nowhere. Dead letters carry the task's properties
and ``RayMQDeadLetterReason``, ``RayMQExceptionType``, ``RayMQExceptionMessage`` and
``RayMQTraceback``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.serve.schema import TaskProcessorAdapter, TaskProcessorConfig, TaskResult

import raymq
from raymq.client.calls import _call
from raymq.config import DEAD_LETTER_SUFFIX
from raymq.core.call_batcher import CallBatcher
from raymq.core.tasks import (
    BATCHED,
    FAILURE,
    FINAL,
    PENDING,
    SUCCESS,
    TASK_ID_PROPERTY,
    TASK_NAME_PROPERTY,
    RetryPolicy,
    TaskEnvelope,
    UndecodableTask,
)
from raymq.errors import ConsumerClosed, InvalidSetting, QueueNotFound, RayMQError
from raymq.placement import spares
from raymq.serve.status_reads import NOT_LOCAL, StatusReads
from raymq.wire.blocking import BlockingClient
from raymq.wire.errors import WireBroken
from raymq.wire.results import PROTOCOL as RESULTS_PROTOCOL
from raymq.wire.results import finish_args, start_record

log = logging.getLogger("raymq.serve")

#: How long a handler thread waits for a task before it checks for a stop (seconds).
RECEIVE_SECONDS = 0.5
#: Dead letters' ``RayMQDeadLetterReason``s.
UNDECODABLE = "undecodable"
UNKNOWN_TASK = "unknown task"
FAILED = "failed"
#: Consumer concurrency when Serve gives none (Serve's own default is 5).
DEFAULT_CONCURRENCY = 5
#: The result store's calls made over the wire's results protocol (every task's two):
#: a tenth of a Ray call's CPU (``raymq.wire.results``).
WIRE_OPS = ("start", "finish")
#: After the results connection failed, calls go through Ray for this long before it is
#: opened again (seconds).
WIRE_RETRY_SECONDS = 1.0


class RayMQAdapterConfig(BaseModel):
    """The RayMQ adapter's settings; ``RayMQAdapterConfig()`` joins the running broker
    of namespace ``"raymq"``. A setting it does not have is refused (a misspelt one
    would otherwise be ignored without a word)."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(default=None, description="Ray address (None: this Ray).")
    namespace: str = Field(default="raymq", description="The broker's Ray namespace.")
    queue_options: dict[str, Any] = Field(
        default_factory=dict,
        description="create_queue's settings (replicas, max_size_bytes, ...) for a queue"
        " created on first use; an existing queue must have them.",
    )
    result_ttl_s: float = Field(default=86400.0, description="Seconds results are kept.")
    retry_delay_s: float = Field(default=1.0, description="Seconds before the first retry.")
    retry_backoff: float = Field(default=2.0, description="Factor of each further delay.")
    max_retry_delay_s: float = Field(default=60.0, description="Longest delay (seconds).")
    prefetch_multiplier: int = Field(
        default=1,
        ge=1,
        description="Tasks a replica holds per handler thread (Celery's"
        " worker_prefetch_multiplier, 4 there): more keeps its threads busy between"
        " tasks; 1 holds only what runs.",
    )


class TaskFailed(Exception):
    """A task's failure, as ``get_task_status_sync`` reports it in ``result``: the
    handler's exception type and text, and its traceback, as recorded."""

    def __init__(self, error_type: str, message: str, traceback_text: str | None = None):
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.traceback = traceback_text


@dataclass
class TaskCounts:
    """What one replica's adapter did since it started (``get_metrics_sync``)."""

    succeeded: int = 0
    failed: int = 0  # failed for good (dead-lettered to the failed-task queue)
    retried: int = 0  # runs that failed and were run again
    unprocessable: int = 0  # unknown names and undecodable bodies (dead-lettered)
    skipped: int = 0  # deliveries of tasks cancelled or finished already
    receive_failures: int = 0  # receives that failed with a typed error (then tried again)


class RayMQTaskProcessorAdapter(TaskProcessorAdapter):
    """Ray Serve's ``TaskProcessorAdapter`` over a RayMQ queue (see the module)."""

    def __init__(self, config: TaskProcessorConfig, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        settings = config.adapter_config
        if settings is None:
            settings = RayMQAdapterConfig()
        elif isinstance(settings, dict):
            settings = RayMQAdapterConfig(**settings)
        elif not isinstance(settings, RayMQAdapterConfig):
            raise TypeError(
                "TaskProcessorConfig.adapter_config must be a raymq.serve.RayMQAdapterConfig,"
                f" not {type(settings).__name__}"
            )
        if not settings.result_ttl_s > 0:  # (pydantic made it a float)
            raise InvalidSetting(f"result_ttl_s must be > 0, not {settings.result_ttl_s}")
        self._config = config
        self._settings = settings
        self._retry = RetryPolicy(
            config.max_retries or 0,
            settings.retry_delay_s,
            settings.retry_backoff,
            settings.max_retry_delay_s,
        )
        self._handlers: dict[str, Callable] = {}
        self._concurrency = DEFAULT_CONCURRENCY
        self._broker: raymq.Broker | None = None
        self._queue: Any = None
        self._results: Any = None  # the TaskResultsActor's handle
        self._status_reads: StatusReads | None = None  # made by initialize
        self._dead_letters: dict[str, Any] = {}  # queue handles by name
        self._consumer: Any = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._running = 0  # handlers running now
        self._completions: ThreadPoolExecutor | None = None  # made by start_consumer
        self._pending: set[futures.Future] = set()  # completions not done yet
        self._batcher = CallBatcher(lambda calls: self._store_call("batch", calls))
        self._wire: BlockingClient | None = None  # the results connection (``_results_wire``)
        self._wire_lock = threading.Lock()
        self._wire_retry_at = 0.0  # monotonic seconds
        self._lock = threading.Lock()
        self.counts = TaskCounts()

    # -- set-up ---------------------------------------------------------------------

    def initialize(self, consumer_concurrency: int = DEFAULT_CONCURRENCY) -> None:
        """Join the broker and open (or create) the task queue."""
        if isinstance(consumer_concurrency, bool) or not isinstance(consumer_concurrency, int):
            raise InvalidSetting(
                f"consumer_concurrency must be an int, not {consumer_concurrency!r}"
            )
        if consumer_concurrency < 1:
            raise InvalidSetting(f"consumer_concurrency must be >= 1, not {consumer_concurrency}")
        self._concurrency = consumer_concurrency
        s = self._settings
        # No warm spare TargetList (``raymq.placement.spares``): a process that only
        # enqueues never uses one, and a replica's one consumer makes its own; an idle
        # Ray worker costs ~0.6 % of a core, 16 replicas' spares a tenth of one.
        self._broker = raymq.connect(s.address, s.namespace, create=False, warm=False)
        self._queue = self._open_queue(self._config.queue_name, s.queue_options)
        self._results = self._broker.task_results()
        node_id = ray.get_runtime_context().get_node_id()
        self._status_reads = StatusReads(lambda: self._store_call("locate"), node_id)

    def _open_queue(self, name: str, options: dict[str, Any]):
        """The queue ``name``: created with ``options`` if missing; with no options,
        an existing queue is taken with whatever settings it has."""
        assert self._broker is not None
        if not options:
            try:
                return self._broker.get_queue(name)
            except QueueNotFound:
                pass
        return self._broker.create_queue(name, **options)

    def register_task_handle(self, func: Callable, name: str | None = None) -> None:
        """Run ``func`` (a function or a coroutine function) for tasks named ``name``
        (default: its ``__name__``)."""
        if not callable(func):
            raise TypeError(f"a task handler must be callable, not {type(func).__name__}")
        self._handlers[name or func.__name__] = func

    # -- producing and asking ---------------------------------------------------------

    def enqueue_task_sync(
        self, task_name: str, args: Any = None, kwargs: Any = None, **options: Any
    ) -> TaskResult:
        """Send a task; its id comes back at once with status PENDING. ``TypeError`` if
        an argument is not a msgpack value; no options are taken (``ValueError``)."""
        if options:
            raise ValueError(f"RayMQ tasks take no enqueue options: {sorted(options)}")
        if not isinstance(task_name, str) or not task_name:
            raise ValueError(f"a task name must be a non-empty str, not {task_name!r}")
        self._require_initialized()
        task = TaskEnvelope(task_name, list(args or ()), dict(kwargs or {}), created_at=time.time())
        # The send is all: a task has no record until it starts (it is PENDING).
        self._queue.send(task.encode(), task.properties(), message_id=task.id)
        return TaskResult(id=task.id, status=PENDING, created_at=task.created_at, result=None)

    def get_task_status_sync(self, task_id: str) -> TaskResult:
        """The task's status; for SUCCESS its result, for FAILURE a ``TaskFailed``.
        A task waiting in its queue is PENDING, and so is an unknown id (never
        enqueued, or expired), as with Celery."""
        self._require_initialized()
        assert self._status_reads is not None
        record = self._status_reads.get(task_id)  # on the store's node: its file
        if record is NOT_LOCAL:
            record = self._store("get", task_id)
        if record is None:
            return TaskResult(id=task_id, status=PENDING, result=None)
        result = record.result
        if record.status == FAILURE:
            result = TaskFailed(
                record.error_type or "Exception", record.error or "", record.traceback
            )
        return TaskResult(
            id=record.id, status=record.status, created_at=record.created_at, result=result
        )

    def cancel_task_sync(self, task_id: str) -> bool:
        """Cancel a task that has not started (it is then never run); False if it has
        started or ended, or is unknown."""
        self._require_initialized()
        # Not tried again: a retry of one that answered nothing would answer False.
        return self._store("cancel", task_id, self._settings.result_ttl_s, retry=False)

    def get_metrics_sync(self) -> dict[str, Any]:
        """The queue's depth (tasks waiting: PENDING) and messages in flight (tasks
        running or about to), the dead letters waiting, the tasks recorded by status
        (and the result store's commits), and this replica's consumer."""
        self._require_initialized()
        stats = self._queue.stats()
        dead = {}
        for name in {self._failed_queue_name(), self._unprocessable_queue_name()}:
            try:
                dead[name] = self._broker.get_queue(name).stats()["depth"]
            except QueueNotFound:
                dead[name] = 0
        return {
            "queue": self._config.queue_name,
            "depth": stats["depth"],
            "in_flight": stats["in_flight"],
            "dead_letters": dead,
            "tasks": self._store("counts"),
            "consumer": self._consumer_state(),
            # get_task_status_sync's reads of the store's file, and the failed ones
            # (those went to the actor): see raymq.serve.status_reads.
            "status_reads_local": self._status_reads.local_reads if self._status_reads else 0,
            "status_read_failures": self._status_reads.failures if self._status_reads else 0,
        }

    def health_check_sync(self) -> list[dict]:
        """``[{"raymq@<replica>": {"ok": "pong" | "down", ...}}]``: down when the
        consumer is not running or a handler thread died."""
        state = self._consumer_state()
        ok = "pong" if state["running"] and state["threads_alive"] == self._concurrency else "down"
        return [{f"raymq@{_replica_tag()}": {"ok": ok, **state}}]

    async def enqueue_task_async(
        self, task_name: str, args: Any = None, kwargs: Any = None, **options: Any
    ) -> TaskResult:
        """``enqueue_task_sync`` off the event loop."""
        return await asyncio.to_thread(self.enqueue_task_sync, task_name, args, kwargs, **options)

    async def get_task_status_async(self, task_id: str) -> TaskResult:
        """``get_task_status_sync`` off the event loop."""
        return await asyncio.to_thread(self.get_task_status_sync, task_id)

    async def cancel_task_async(self, task_id: str) -> bool:
        """``cancel_task_sync`` off the event loop."""
        return await asyncio.to_thread(self.cancel_task_sync, task_id)

    async def get_metrics_async(self) -> dict[str, Any]:
        """``get_metrics_sync`` off the event loop."""
        return await asyncio.to_thread(self.get_metrics_sync)

    async def health_check_async(self) -> list[dict]:
        """``health_check_sync`` off the event loop."""
        return await asyncio.to_thread(self.health_check_sync)

    # -- consuming --------------------------------------------------------------------

    def start_consumer(self, **kwargs: Any) -> None:
        """Start ``consumer_concurrency`` handler threads over one consumer (again
        after a ``stop_consumer``; nothing if running)."""
        self._require_initialized()
        if self._consumer is not None:
            return
        self._stopping.clear()
        prefetch = self._concurrency * self._settings.prefetch_multiplier
        with spares.none_started():  # a replica's next consumer comes seldom, if ever
            self._consumer = self._queue.consumer(prefetch=prefetch)
        # Outcomes are stored, and tasks acknowledged, beside the handler threads: a
        # thread takes its next task meanwhile (its slot is free once it is acked).
        self._completions = ThreadPoolExecutor(
            max_workers=self._concurrency, thread_name_prefix="raymq-task-done"
        )
        self._threads = [
            threading.Thread(
                target=self._work, args=(self._consumer,), name=f"raymq-task-{i}", daemon=True
            )
            for i in range(self._concurrency)
        ]
        for thread in self._threads:
            thread.start()
        log.info(
            "queue %r: %d task handler threads started", self._config.queue_name, self._concurrency
        )

    def stop_consumer(self, timeout: float = 10.0) -> None:
        """Take no new task; let the running ones finish for up to ``timeout`` seconds;
        then close the consumer, which gives back what was not started (and what still
        runs, logged: it runs again elsewhere)."""
        consumer = self._consumer
        if consumer is None:
            return
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        with self._lock:
            pending = list(self._pending)
        futures.wait(pending, max(deadline - time.monotonic(), 0.0))
        if self._completions is not None:
            self._completions.shutdown(wait=False, cancel_futures=True)
            self._completions = None
        still = sum(t.is_alive() for t in self._threads) + sum(not f.done() for f in pending)
        if still:
            log.warning(
                "queue %r: %d tasks still running after %.1f s; given back",
                self._config.queue_name,
                still,
                timeout,
            )
        consumer.close()
        self._consumer = None
        self._threads = []

    def _work(self, consumer: Any) -> None:
        """One handler thread: receive a task, run it, until the stop."""
        while not self._stopping.is_set():
            try:
                messages = consumer.receive(1, timeout=RECEIVE_SECONDS)
            except ConsumerClosed:
                return
            except RayMQError as exc:  # the queue restarting, say: this thread goes on
                self.counts.receive_failures += 1
                log.warning("queue %r: a receive failed: %r", self._config.queue_name, exc)
                self._stopping.wait(RECEIVE_SECONDS)
                continue
            for message in messages:
                try:
                    self._handle(consumer, message)
                except ConsumerClosed:
                    return
                except Exception:  # noqa: BLE001 - the store or the broker: given back
                    log.exception(
                        "queue %r: task at offset %d: given back",
                        self._config.queue_name,
                        message.offset,
                    )
                    try:
                        consumer.nack(message)
                    except Exception:  # noqa: BLE001 - closing gives it back in the end
                        log.exception("queue %r: a nack failed", self._config.queue_name)

    def _handle(self, consumer: Any, message: Any) -> None:
        """Run one delivered task: record its outcome, then acknowledge it; or, when it
        raised with retries left, nack it with the retry's delay."""
        try:
            task = TaskEnvelope.decode(message.body)
        except UndecodableTask as exc:
            self._give_up(consumer, message, None, UNDECODABLE, exc)
            return
        handler = self._handlers.get(task.name)
        if handler is None:
            exc = LookupError(f"no handler for task {task.name!r}")
            self._give_up(consumer, message, task, UNKNOWN_TASK, exc)
            return
        ttl = self._settings.result_ttl_s
        record = self._store("start", task.id, task.name, ttl)
        if record.status in FINAL:  # cancelled, or run to its end before a redelivery
            self.counts.skipped += 1
            consumer.ack(message)
            return
        if record.runs > 1 + self._retry.max_retries:  # its replica died on each run
            exc = RuntimeError(f"task {task.id}: {record.runs - 1} runs never finished")
            self._give_up(consumer, message, task, FAILED, exc)
            return
        try:
            value = self._run(handler, task)
        except Exception as exc:  # noqa: BLE001 - the handler's failure: its outcome
            text = traceback.format_exc()
            if self._retry.retries_left(record.runs):
                self.counts.retried += 1
                # Runs again after the delay, here or on another replica; its runs
                # are counted by the store.
                consumer.nack(message, delay=self._retry.delay(record.runs))
                return
            self._give_up(consumer, message, task, FAILED, exc, text)
            return
        completions = self._completions
        if self._settings.prefetch_multiplier == 1 or completions is None:
            # Its slot frees only at the ack: nothing to gain from a completion thread
            # (none is left either when this handler outlived stop_consumer's timeout).
            self._complete(consumer, message, task, value)
            return
        done = completions.submit(self._complete, consumer, message, task, value)
        with self._lock:
            self._pending.add(done)
        done.add_done_callback(self._completed)

    def _complete(self, consumer: Any, message: Any, task: TaskEnvelope, value: Any) -> None:
        """Store a task's result, then acknowledge it (a completion thread); if that
        fails, give it back: it runs again."""
        try:
            try:
                self._store(
                    "finish", task.id, task.name, self._settings.result_ttl_s, SUCCESS, value
                )
            except TypeError as exc:  # not a msgpack value: recorded as the failure it is
                self._finish_failed(task, exc, "")
                with self._lock:  # several completion threads count
                    self.counts.failed += 1
            else:
                with self._lock:
                    self.counts.succeeded += 1
            consumer.ack(message)
        except ConsumerClosed:
            pass  # stopped: the queue delivers it again
        except Exception:  # noqa: BLE001 - the store or the broker: given back
            log.exception(
                "queue %r: task at offset %d: given back", self._config.queue_name, message.offset
            )
            with contextlib.suppress(Exception):  # closing gives it back in the end
                consumer.nack(message)

    def _completed(self, done: futures.Future) -> None:
        with self._lock:
            self._pending.discard(done)

    def _give_up(
        self,
        consumer: Any,
        message: Any,
        task: TaskEnvelope | None,
        reason: str,
        exc: BaseException,
        text: str = "",
    ) -> None:
        """A task that will not run (again): dead-lettered (an undecodable body or an
        unknown name to the unprocessable-task queue, else to the failed-task one),
        then recorded FAILURE (so that once its status is FAILURE, its dead letter is
        in), then acknowledged."""
        unprocessable = reason in (UNDECODABLE, UNKNOWN_TASK)
        queue = self._unprocessable_queue_name() if unprocessable else self._failed_queue_name()
        self._dead_letter(queue, message, reason, exc, text)
        if task is not None:
            self._finish_failed(task, exc, text)
        if unprocessable:
            self.counts.unprocessable += 1
        else:
            self.counts.failed += 1
        consumer.ack(message)

    def _run(self, handler: Callable, task: TaskEnvelope) -> Any:
        with self._lock:
            self._running += 1
        try:
            if inspect.iscoroutinefunction(handler):
                return asyncio.run(handler(*task.args, **task.kwargs))
            return handler(*task.args, **task.kwargs)
        finally:
            with self._lock:
                self._running -= 1

    def _finish_failed(self, task: TaskEnvelope, exc: BaseException, text: str) -> None:
        self._store(
            "finish",
            task.id,
            task.name,
            self._settings.result_ttl_s,
            FAILURE,
            None,
            type(exc).__name__,
            str(exc),
            text or None,
        )

    def _dead_letter(
        self,
        queue_name: str,
        message: Any,
        reason: str,
        exc: BaseException,
        text: str = "",
    ) -> None:
        """Send the task's message to ``queue_name`` (created durable if missing)."""
        handle = self._dead_letters.get(queue_name)
        if handle is None:
            handle = self._dead_letters[queue_name] = self._open_queue(queue_name, {})
        props = dict(message.properties)
        props.update(
            RayMQDeadLetterReason=reason,
            RayMQOriginalQueue=self._config.queue_name,
            RayMQOriginalOffset=message.offset,
            RayMQExceptionType=type(exc).__name__,
            RayMQExceptionMessage=str(exc)[:4096],
        )
        if text:
            props["RayMQTraceback"] = text[-16384:]
        handle.send(message.body, props)
        log.warning(
            "queue %r: task %s (%s) dead-lettered to %r: %s: %s",
            self._config.queue_name,
            props.get(TASK_ID_PROPERTY, "?"),
            props.get(TASK_NAME_PROPERTY, "?"),
            queue_name,
            reason,
            exc,
        )

    # -- helpers ------------------------------------------------------------------------

    def _failed_queue_name(self) -> str:
        return self._config.failed_task_queue_name or self._config.queue_name + DEAD_LETTER_SUFFIX

    def _unprocessable_queue_name(self) -> str:
        return (
            self._config.unprocessable_task_queue_name
            or self._config.queue_name + DEAD_LETTER_SUFFIX
        )

    def _consumer_state(self) -> dict[str, Any]:
        return {
            "running": self._consumer is not None and not self._stopping.is_set(),
            "threads_alive": sum(t.is_alive() for t in self._threads),
            "handlers_running": self._running,
            "concurrency": self._concurrency,
            **asdict(self.counts),
        }

    def _store(self, op: str, *args: Any, retry: bool = True) -> Any:
        """Call ``op`` of the broker's TaskResultsActor: its typed errors raised, a
        restart waited out (``raymq.client.calls._call``), the actor found again by the
        broker if it was ended (a broker restarted), ``BrokerUnavailable`` past that.
        A task's start and finish go over the wire (``WIRE_OPS``); through Ray, when it
        is broken, they share calls from all threads (``CallBatcher``)."""
        if op in WIRE_OPS and retry:
            client = self._results_wire()
            if client is not None:
                try:
                    if op == "start":
                        return start_record(client.call("start", list(args)).value)
                    client.call("finish", finish_args(*args))
                    return None
                except WireBroken as exc:  # through Ray below (a lost start counts twice)
                    self._wire_broke(client, exc)
        if op in BATCHED and retry:
            return self._batcher.call(op, args)
        return self._store_call(op, *args, retry=retry)

    def _results_wire(self) -> BlockingClient | None:
        """The results connection to the store, opened on first use and after it broke
        (not within ``WIRE_RETRY_SECONDS`` of a failure); None: use Ray calls."""
        with self._wire_lock:
            client = self._wire
            if client is not None and client.broken is None:
                return client
            if time.monotonic() < self._wire_retry_at:
                return None
            try:
                endpoint = self._store_call("results_endpoint")
                client = BlockingClient(tuple(endpoint), RESULTS_PROTOCOL, "task results")
            except Exception as exc:  # noqa: BLE001 - Ray calls then; they raise what persists
                self._wire_retry_at = time.monotonic() + WIRE_RETRY_SECONDS
                log.info("queue %r: task results through Ray: %r", self._config.queue_name, exc)
                return None
            self._wire = client
            return client

    def _wire_broke(self, client: BlockingClient, exc: WireBroken) -> None:
        log.info("queue %r: the task results connection broke: %r", self._config.queue_name, exc)
        client.close()
        with self._wire_lock:
            if self._wire is client:
                self._wire = None
                self._wire_retry_at = time.monotonic() + WIRE_RETRY_SECONDS

    def _store_call(self, op: str, *args: Any, retry: bool = True) -> Any:
        def again() -> Any:
            assert self._broker is not None
            self._results = self._broker.task_results()
            return getattr(self._results, op)

        return _call(
            getattr(self._results, op), *args, retry=retry, refresh=again, about="task results"
        )

    def _require_initialized(self) -> None:
        if self._queue is None:
            raise RuntimeError("RayMQTaskProcessorAdapter: initialize() first")


def _replica_tag() -> str:
    """This Serve replica's tag, or host:pid outside a replica."""
    try:
        from ray.serve import get_replica_context

        return get_replica_context().replica_tag
    except Exception:  # noqa: BLE001 - not in a replica (a driver enqueuing)
        return f"{os.uname().nodename}:{os.getpid()}"


__all__ = [
    "RayMQAdapterConfig",
    "RayMQTaskProcessorAdapter",
    "TaskCounts",
    "TaskFailed",
]
