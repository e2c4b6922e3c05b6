"""Spark DataFrames in and out of queues, through Spark on Ray (RayDP).

    spark = raymq.spark.init_spark()          # RayDP with the JVM options Java 17 needs
    raymq.spark.send_dataframe(df, queue)     # rows -> messages, from Ray tasks
    df = raymq.spark.read_queue(spark, queue, selector="color = 'red'")
    raymq.spark.stop_spark()

Sending never brings rows to the driver: ``ray.data.from_spark`` (RayDP) turns the
DataFrame's partitions into Arrow blocks in the object store, and ``map_batches`` tasks,
scheduled next to those blocks, encode them (``raymq.data.encode_arrow``, the bytes
``Queue.send_batch`` would write) and send them to the queue actor; only a count per
batch comes back to the driver. Reading leases the messages (``raymq.data.QueueReader``),
has Ray Data's read tasks read them into Arrow blocks in the object store, turns those
into Arrow IPC objects beside them that RayDP's JVM executors read themselves (no
Python worker in Spark, no pandas), materializes the DataFrame in Spark
(``localCheckpoint``) and only then acknowledges the messages.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

from raymq.arrow_messages import DEFAULT_BATCH_ROWS, encode_arrow, progress_bar, resolve_queue
from raymq.client import Broker, Queue
from raymq.client.calls import _call
from raymq.config import apply_ray_env_defaults
from raymq.errors import InvalidSetting, RayMQError
from raymq.jvm_leftovers import SessionJvms
from raymq.queue_reader import QueueReader, leased_blocks

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

#: Packages of java.base that Spark (and RayDP's Arrow code) reach into by reflection;
#: Java 17 forbids it unless each is opened to the unnamed module.
JAVA_ADD_OPENS = (
    "java.lang",
    "java.lang.invoke",
    "java.lang.reflect",
    "java.io",
    "java.net",
    "java.nio",
    "java.math",
    "java.text",
    "java.time",
    "java.util",
    "java.util.concurrent",
    "java.util.concurrent.atomic",
    "java.util.regex",
    "sun.nio.ch",
    "sun.nio.cs",
    "sun.security.action",
    "sun.util.calendar",
)
JAVA_OPTIONS = " ".join(f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in JAVA_ADD_OPENS)
#: Where the options must go: the Spark driver JVM and RayDP's app master JVM (which
#: starts the executors). Either alone fails on Java 17; ``JobConfig(jvm_options=...)``
#: does not reach RayDP's Java actors.
JAVA_OPTION_KEYS = ("spark.driver.extraJavaOptions", "spark.ray.raydp_app_master.extraJavaOptions")
#: Spark settings RayMQ applies unless the caller sets them.
DEFAULT_CONFIGS = {
    # RayMQ draws its own progress bars; Spark's stage bars would interleave with them.
    "spark.ui.showConsoleProgress": "false",
}
#: Rows per ``Queue.send_batch`` (one write and one fsync each).
DEFAULT_SEND_ROWS = 10_000

# Java's default temporary directory on Linux, whatever TMPDIR says; Ray's Java driver
# hard-codes /tmp/ray/<epoch ms> for its native library.
#: The JVMs of the running session and the /tmp files they use (None: no session).
_session: SessionJvms | None = None


# -- session ------------------------------------------------------------------------


def spark_configs(configs: Mapping[str, Any] | None = None) -> dict[str, str]:
    """``configs`` merged with RayMQ's: the Java 17 options prepended to the user's own
    ``spark.driver.extraJavaOptions`` and ``spark.ray.raydp_app_master.extraJavaOptions``,
    and ``DEFAULT_CONFIGS`` where the user set nothing."""
    merged = dict(DEFAULT_CONFIGS)
    merged.update({str(k): str(v) for k, v in (configs or {}).items()})
    for key in JAVA_OPTION_KEYS:
        user = merged.get(key, "").strip()
        # Ours first: for repeated -D/-X options the JVM keeps the last, the user's.
        merged[key] = user if JAVA_OPTIONS in user else f"{JAVA_OPTIONS} {user}".strip()
    return merged


def init_spark(
    app_name: str = "raymq",
    num_executors: int = 1,
    executor_cores: int = 1,
    executor_memory: str | int = "1g",
    configs: Mapping[str, Any] | None = None,
) -> SparkSession:
    """Start Spark on Ray (RayDP) configured for RayMQ; returns the SparkSession.

    Joins the running Ray, or starts a local one as ``raymq.connect`` would. Each of
    ``num_executors`` executors is a Ray actor with ``executor_cores`` CPUs and
    ``executor_memory`` (bytes, or a size such as ``"1g"``). ``configs`` are extra
    Spark settings, merged with the JVM options Java 17 needs (``spark_configs``).
    Sets ``PYSPARK_PYTHON`` to this interpreter when unset. Spark on Ray takes about
    10 s to start; raises ``RuntimeError`` if it is running already.
    """
    import raydp

    global _session
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if not ray.is_initialized():
        apply_ray_env_defaults()
        ray.init(log_to_driver=False, configure_logging=False)
    try:
        spark = raydp.init_spark(
            app_name,
            num_executors,
            executor_cores,
            executor_memory,
            configs=spark_configs(configs),
        )
    except Exception as exc:
        if "has inited" in str(exc):
            raise RuntimeError(
                "Spark on Ray is already running in this process; "
                "call raymq.spark.stop_spark() first"
            ) from None
        _clean_up(_session_jvms(), JVM_EXIT_SECONDS)
        raise
    _session = _session_jvms()
    return spark


def stop_spark(cleanup: bool = True) -> None:
    """Stop Spark on Ray (its executors and app master) and the Spark driver JVM.

    Ending the driver JVM that PySpark started lets it remove its own temporary files
    (the next ``init_spark`` starts a fresh one). With ``cleanup``, waits up to
    ``JVM_EXIT_SECONDS`` for this session's JVMs to exit, then removes what they leave
    in /tmp (killed JVMs remove nothing): Ray's Java native library (about 40 MB per
    JVM, under /tmp/ray/<epoch ms>), lz4-java libraries and perf data files. Only the
    files this session's JVMs were seen to use go, never one a live process maps
    (``raymq.jvm_leftovers``): other processes' Spark and Java workers keep theirs.
    """
    import raydp
    from pyspark import SparkContext

    global _session
    gateway = SparkContext._gateway
    session = _session
    if cleanup and session is not None:
        session.merge(_session_jvms())  # executors started since init_spark too
    try:
        raydp.stop_spark()
    finally:
        if gateway is not None:
            _end_gateway(gateway)
        if cleanup and session is not None:
            _clean_up(session, JVM_EXIT_SECONDS)
        _session = None


#: How long ``stop_spark`` waits for RayDP's JVMs to exit before cleaning (seconds);
#: they take about 2 s after their actors are killed.
JVM_EXIT_SECONDS = 10.0


def _session_jvms() -> SessionJvms:
    """The JVMs of this process's Spark session, and their /tmp files, as they run."""
    from pyspark import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    return SessionJvms.find(getattr(proc, "pid", None))


def _clean_up(session: SessionJvms, timeout: float) -> list[str]:
    """Wait up to ``timeout`` seconds for ``session``'s JVMs to exit, then remove what
    they left in /tmp; returns the paths removed."""
    deadline = time.monotonic() + timeout
    while session.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return session.remove()


def _end_gateway(gateway: Any) -> None:
    """End PySpark's driver JVM: it exits (running its shutdown hooks) when its stdin
    closes; PySpark launches a new one for the next SparkContext."""
    from pyspark import SparkContext

    proc = getattr(gateway, "proc", None)
    with contextlib.suppress(Exception):
        gateway.shutdown()
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.stdin.close()
            proc.wait(timeout=JVM_EXIT_SECONDS)
    SparkContext._gateway = None
    SparkContext._jvm = None


# -- Spark DataFrame -> queue --------------------------------------------------------


@dataclass(frozen=True)
class _QueueAddress:
    """What a Ray task needs to send to a queue. A ``Queue`` handle itself does not
    pickle (it holds locks for coalescing single sends), and a batch send needs only the
    queue actor and the broker's ``max_message_size``."""

    name: str
    queue_actor: Any
    max_message_size: int

    @classmethod
    def of(cls, queue: Queue) -> _QueueAddress:
        return cls(queue.name, queue._actor, queue.broker.config.max_message_size)


def _send_batch(batch: pa.Table, address: _QueueAddress, timeout: float | None) -> pa.Table:
    """``map_batches`` function: send one Arrow batch (body + property columns) as
    ``Queue.send_batch`` would, with the properties encoded by ``encode_arrow`` (the
    same bytes, several times faster)."""
    sent = 0
    if batch.num_rows:
        messages = encode_arrow(
            batch, max_message_size=address.max_message_size, queue=address.name
        )
        # _call: the client's typed errors and its waiting out of a restarting actor.
        _first, sent = _call(address.queue_actor.send_batch, messages, timeout)
    return pa.table({"rows": pa.array([batch.num_rows], pa.int64()), "sent": [sent]})


def _typed_error(exc: BaseException) -> BaseException | None:
    """The RayMQError behind a Ray Data failure, without Ray's wrapper if it has one."""
    wrapped = None
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RayMQError):
            if not isinstance(e, ray.exceptions.RayError):
                return e
            wrapped = e  # RayTaskError(MessageTooLarge): its .cause is the plain error
        todo += [e.__context__, e.__cause__, getattr(e, "cause", None)]
    return wrapped


_PROPERTY_TYPES = (
    "StringType",
    "BooleanType",
    "ByteType",
    "ShortType",
    "IntegerType",
    "LongType",
    "FloatType",
    "DoubleType",
    "NullType",
)
_BODY_TYPES = ("BinaryType", "StringType")


def _message_columns(df: DataFrame, body: str, properties: Sequence[str] | None) -> list[str]:
    """Check the body and property columns against the DataFrame's schema; returns the
    property column names. Raises before anything is sent."""
    types = {f.name: type(f.dataType).__name__ for f in df.schema.fields}
    if body not in types:
        raise TypeError(f"DataFrame has no body column {body!r}; columns: {sorted(types)}")
    if types[body] not in _BODY_TYPES:
        raise TypeError(f"body column {body!r} must be binary or string, not {types[body]}")
    if properties is None:
        props = [c for c in types if c != body]
    else:
        if isinstance(properties, str):
            raise TypeError("properties must be a list of column names, not one str")
        props = list(properties)
        missing = [c for c in props if c not in types]
        if missing:
            raise TypeError(f"DataFrame has no property columns {missing}")
        if body in props:
            raise TypeError(f"column {body!r} is the body; it cannot also be a property")
    if "body" in props:
        raise TypeError("a property may not be named 'body' (the body column's name in Arrow)")
    if len(set(props)) != len(props):
        raise TypeError(f"property columns listed twice: {props}")
    bad = {c: types[c] for c in props if types[c] not in _PROPERTY_TYPES}
    if bad:
        raise TypeError(
            f"property columns must be string, boolean, integral or floating; {bad} are not"
            " (cast or drop them, or pass properties=[...])"
        )
    return props


def send_dataframe(
    df: DataFrame,
    queue: Queue | str,
    body: str = "body",
    properties: Sequence[str] | None = None,
    batch_rows: int = DEFAULT_SEND_ROWS,
    *,
    broker: Broker | None = None,
    timeout: float | None = None,
    progress: bool = True,
) -> int:
    """Send each row of a Spark DataFrame as a message; returns how many were stored.

    ``body`` names the binary (or string) column that becomes each message's body;
    ``properties`` the columns that become properties (None: every other column;
    string, boolean, integral and floating columns only, nulls are absent properties).
    ``queue`` is a ``Queue`` handle, or a name with ``broker=``. Rows go from Spark to
    the object store through RayDP and are sent by Ray tasks next to them, in batches of
    ``batch_rows`` messages (one write and one fsync each); no row passes through the
    driver. ``timeout`` (seconds) applies to each batch under the BLOCK policy; under
    DROP the count returned is what was stored. Messages of a batch whose task Ray
    retries may be stored twice (at-least-once).
    """
    from pyspark.sql import functions as F
    from raydp.spark import release_spark_recoverable

    q = resolve_queue(queue, broker)
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise InvalidSetting(f"batch_rows={batch_rows!r} must be an int >= 1")
    props = _message_columns(df, body, properties)
    selected = df.select(F.col(_quoted(body)).alias("body"), *[F.col(_quoted(c)) for c in props])
    sent = 0
    try:
        with _ray_data_settings():
            ds = ray.data.from_spark(selected)  # partitions -> Arrow blocks in the object store
            total = ds.count()  # from the blocks' metadata: nothing is read
            sends = ds.map_batches(
                _send_batch,
                fn_kwargs={"address": _QueueAddress.of(q), "timeout": timeout},
                batch_format="pyarrow",
                batch_size=batch_rows,
                zero_copy_batch=True,
            )
            with progress_bar(f"sending to {q.name}", total, progress) as bar:
                # Only the per-batch counts come back to the driver.
                for out in sends.iter_batches(batch_size=None, batch_format="pyarrow"):
                    sent += pc.sum(out["sent"]).as_py() or 0
                    bar.advance(pc.sum(out["rows"]).as_py() or 0)
    except Exception as exc:
        typed = _typed_error(exc)
        if typed is not None and typed is not exc:
            raise typed from None
        raise
    finally:
        release_spark_recoverable(selected)  # Spark cached the partitions for from_spark
    return sent


@contextlib.contextmanager
def _ray_data_settings() -> Iterator[None]:
    """Ray Data as ``send_dataframe`` needs it, restored after: a failing batch raises
    what ``send_batch`` raised (``MessageTooLarge``, ``AddressFull``, ...) rather than a
    generic UserCodeException, and Ray Data's progress bars and execution logs are off
    (they would interleave with our progress bar)."""
    import logging

    ctx = ray.data.DataContext.get_current()
    names = ("enable_progress_bars", "print_on_execution_start", "raise_original_map_exception")
    saved = {n: getattr(ctx, n) for n in names}
    logger = logging.getLogger("ray.data")
    level = logger.level
    ctx.enable_progress_bars = ctx.print_on_execution_start = False
    ctx.raise_original_map_exception = True
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(ctx, n, v)
        logger.setLevel(level)


# -- queue -> Spark DataFrame --------------------------------------------------------


@ray.remote(num_cpus=0)
def _ipc_block(table: pa.Table) -> bytes:
    """``_ipc_bytes`` in a task beside the block."""
    return _ipc_bytes(table)


def _ipc_bytes(table: pa.Table) -> bytes:
    """A table as one Arrow IPC stream, the block format RayDP's JVM reads."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _spark_schema(schema: pa.Schema) -> StructType:
    """The Spark schema of Arrow blocks (every column nullable)."""
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructField, StructType

    return StructType([StructField(f.name, from_arrow_type(f.type), True) for f in schema])


def read_queue(
    spark: SparkSession,
    queue: Queue | str,
    selector: str | None = None,
    max_messages: int | None = None,
    timeout: float = 2.0,
    *,
    broker: Broker | None = None,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    headers: bool = True,
    progress: bool = True,
) -> DataFrame:
    """Consume (and acknowledge) what a queue holds into a Spark DataFrame.

    Columns: ``offset`` (long), ``timestamp`` (when the queue stored the message),
    ``body`` (binary), then one column per property (see ``raymq.data``);
    ``headers=False`` leaves out offset and timestamp. A ``raymq.data.QueueReader``
    leases the messages (``selector``: a JMS selector over the properties; at most
    ``max_messages``; when the queue has none for the reader, it waits up to
    ``timeout`` seconds for a first one) and Ray Data's read tasks read them into Arrow
    blocks, turned into Arrow IPC objects beside them for RayDP's JVM: nothing passes
    through the driver but offsets. The DataFrame is materialized in Spark's executors
    (``localCheckpoint``) before the messages are acknowledged, so a failure on the way
    (or a driver that dies) leaves them in the queue. One Spark partition per
    ``batch_rows`` messages.
    """
    from raydp.spark import ray_dataset_to_spark_dataframe

    reader = QueueReader(
        resolve_queue(queue, broker),
        selector=selector,
        max_messages=max_messages,
        batch_rows=batch_rows,
        headers=headers,
        progress=progress,
        timeout=timeout,
    )
    with leased_blocks(reader) as got:
        if not got.refs:
            # From an empty JVM-side RDD: no Python worker, no Spark job.
            empty = spark.sparkContext.emptyRDD()
            return spark.createDataFrame(empty, _spark_schema(got.schema))
        blocks = [_ipc_block.remote(ref) for ref in got.refs]
        got.refs.clear()  # the table blocks are no longer needed
        df = ray_dataset_to_spark_dataframe(spark, got.schema, blocks)
        # Materialized in Spark, the DataFrame no longer needs the blocks, and what the
        # caller holds is safe before the queue forgets it.
        df = df.localCheckpoint(eager=True)
        del blocks
        reader.commit()
        return df


def _quoted(name: str) -> str:
    """A column reference Spark takes literally (names may hold dots or backquotes)."""
    return "`" + name.replace("`", "``") + "`"
