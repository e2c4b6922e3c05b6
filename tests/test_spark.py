"""Spark on Ray (RayDP) to and from queues: one Spark session for the whole module.

Spark on Ray takes 10 to 20 s to start and its first job several more, so the session
is module-scoped; each test still gets its own broker (``broker`` fixture). Expected
rows are computed in Python, not read back from Spark, so a comparison cannot agree
with a wrong Spark-side view of the data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

import pyarrow as pa
import pytest

import raymq.client
import raymq.data
import raymq.spark
from raymq.errors import MessageTooLarge
from raymq.jvm_leftovers import process_tree, subtree

N = 100_000
COLORS = ("red", "green", "blue")


def expected_row(i: int) -> tuple[bytes, str, float]:
    """Row ``i`` of ``events``: body, color, amount (a multiple of 1/4: exact in binary)."""
    return (f"event-{i}".encode(), COLORS[i % 3], i * 0.25)


def _java_library_dirs_of_our_jvms() -> set[str]:
    """The /tmp/ray/<epoch ms> directories whose Ray Java library the JVMs of this test
    session (processes descending from it: the Spark driver, RayDP's Java workers) have
    loaded. Other processes on the machine make such directories too: not ours."""
    found = set()
    for pid in subtree(process_tree(), os.getpid()):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if path.endswith("/libcore_worker_library_java.so") and path.startswith(
                    "/tmp/ray/"
                ):
                    found.add(os.path.dirname(path))
    return found


@pytest.fixture(scope="module")
def spark(ray_session):
    """One Spark on Ray session for the module, stopped (and its /tmp files removed)
    at the end."""
    session = raymq.spark.init_spark(app_name="raymq-test", executor_memory="1g")
    yield session
    ours = _java_library_dirs_of_our_jvms()
    assert ours, "no JVM of this session has Ray's Java library from /tmp/ray loaded"
    # Another process's Java library, extracted after our session started (what
    # stop_spark removed until it knew its own JVMs' files).
    other = f"/tmp/ray/{int(time.time() * 1000)}"
    os.makedirs(other)
    with open(os.path.join(other, "libcore_worker_library_java.so"), "wb") as f:
        f.write(b"not ours")
    try:
        raymq.spark.stop_spark()
        # stop_spark removed Ray's Java library (40 MB per JVM) of each of our JVMs.
        assert not [d for d in ours if os.path.exists(d)], ours
        assert os.path.exists(other), "stop_spark removed another process's library"
    finally:
        shutil.rmtree(other, ignore_errors=True)


@pytest.fixture(scope="module")
def events(spark):
    """N rows: a binary body and two property columns (string color, double amount),
    in 4 partitions so several Ray tasks send at once."""
    from pyspark.sql import functions as F

    return spark.range(0, N, numPartitions=4).select(
        F.format_string("event-%d", "id").cast("binary").alias("body"),
        F.element_at(F.array(*[F.lit(c) for c in COLORS]), (F.col("id") % 3 + 1).cast("int")).alias(
            "color"
        ),
        (F.col("id") * 0.25).alias("amount"),
    )


def rows_of(df, columns=("body", "color", "amount")) -> list[tuple]:
    """A Spark DataFrame's rows as sorted tuples, collected as Arrow (seconds faster than
    Row objects for 100,000 rows)."""
    batches = df.select(*columns)._collect_as_arrow()
    table = pa.Table.from_batches(batches) if batches else pa.table({c: [] for c in columns})
    return sorted(table_rows(table, columns))


def table_rows(table: pa.Table, columns=("body", "color", "amount")) -> list[tuple]:
    """An Arrow table's rows as tuples of ``columns``."""
    return list(zip(*(table[c].to_pylist() for c in columns), strict=True))


def arrow_of(ds) -> pa.Table:
    """A Ray Dataset's blocks as one Arrow table."""
    import ray

    return pa.concat_tables(ray.get(ds.to_arrow_refs()))


def test_round_trip_of_100k_rows_is_exact(spark, events, broker):
    q = broker.create_queue("events")
    assert raymq.spark.send_dataframe(events, q, batch_rows=25_000) == N
    stats = q.stats()
    assert stats["depth"] == N and stats["next_offset"] == N

    got = raymq.spark.read_queue(spark, q, timeout=0.5)  # until the queue is idle
    assert got.columns == ["offset", "timestamp", "body", "color", "amount"]
    rows = rows_of(got, ("offset", "body", "color", "amount"))
    assert [r[0] for r in rows] == list(range(N))  # each message once
    assert sorted(r[1:] for r in rows) == sorted(expected_row(i) for i in range(N))
    assert got.where("timestamp IS NULL").count() == 0
    stats = q.stats()  # acknowledged: nothing left, nothing held
    assert stats["depth"] == 0 and stats["in_flight"] == 0 and stats["messages_acked"] == N


def test_selectors_on_columns_that_became_properties(spark, events, broker):
    q = broker.create_queue("colors")
    assert raymq.spark.send_dataframe(events, q) == N

    red = raymq.spark.read_queue(spark, q, selector="color = 'red'", timeout=0.5)
    assert rows_of(red) == sorted(expected_row(i) for i in range(0, N, 3))

    # A plain consumer selecting on both properties, then a Ray Dataset of what is left.
    def blue_below_5000(i: int) -> bool:
        return COLORS[i % 3] == "blue" and i * 0.25 < 5000

    want = sorted(expected_row(i) for i in range(N) if blue_below_5000(i))
    got = []
    with q.consumer(selector="color = 'blue' AND amount < 5000", prefetch=5000) as c:
        # A late consumer scans 100,000 stored property maps first: receive as long as
        # the queue has anything for it (its backlog), however long that takes here.
        deadline = time.monotonic() + 120
        while (batch := c.receive_batch(5000, timeout=1)).num_rows or c.backlog():
            if batch.num_rows:
                got += table_rows(raymq.data.delivery_to_table(batch))
                c.ack(batch)
            assert time.monotonic() < deadline, f"stalled after {len(got)} of {len(want)}"
    assert sorted(got) == want

    rest = raymq.data.read_queue(q, selector="color <> 'red'", max_messages=N, timeout=0.5)
    assert sorted(table_rows(arrow_of(rest))) == sorted(
        expected_row(i) for i in range(N) if COLORS[i % 3] != "red" and not blue_below_5000(i)
    )
    assert q.stats()["depth"] == 0


def test_body_column_property_subset_and_nulls(spark, broker):
    from pyspark.sql import Row

    df = spark.createDataFrame(
        [
            Row(payload="a", kind="x", n=1, flag=True, note="ignored"),
            Row(payload="b", kind=None, n=2, flag=False, note="ignored"),
            Row(payload="c", kind="y", n=None, flag=None, note="ignored"),
        ]
    )
    q = broker.create_queue("subset")
    sent = raymq.spark.send_dataframe(
        df, "subset", body="payload", properties=["kind", "n", "flag"], broker=broker
    )
    assert sent == 3
    by_body = {m.body: m.properties for m in q.browse()}
    assert by_body == {
        b"a": {"kind": "x", "n": 1, "flag": True},
        b"b": {"n": 2, "flag": False},  # nulls are absent properties
        b"c": {"kind": "y"},
    }
    ds = raymq.data.read_queue(q, max_messages=3, headers=False, progress=False)
    rows = sorted(ds.take_all(), key=lambda r: r["body"])
    assert [list(r) for r in rows] == [["body", "kind", "n", "flag"]] * 3
    assert [(r["body"], r["kind"], r["n"], r["flag"]) for r in rows] == [
        (b"a", "x", 1, True),
        (b"b", None, 2, False),
        (b"c", "y", None, None),
    ]


def test_bad_columns_raise_before_anything_is_sent(spark, broker):
    from pyspark.sql import functions as F

    q = broker.create_queue("strict")
    df = spark.range(10).select(
        F.col("id").cast("string").cast("binary").alias("body"),
        F.current_timestamp().alias("at"),
        F.col("id"),
    )
    with pytest.raises(TypeError, match="at"):
        raymq.spark.send_dataframe(df, q)
    with pytest.raises(TypeError, match="no body column"):
        raymq.spark.send_dataframe(df, q, body="payload")
    with pytest.raises(TypeError, match="no property columns"):
        raymq.spark.send_dataframe(df, q, properties=["missing"])
    with pytest.raises(TypeError, match="broker="):
        raymq.spark.send_dataframe(df, "strict", properties=["id"])
    assert q.stats()["next_offset"] == 0
    assert raymq.spark.send_dataframe(df, q, properties=["id"], progress=False) == 10


def test_errors_in_sending_tasks_come_back_typed(spark, broker_factory):
    from pyspark.sql import functions as F

    broker = broker_factory(max_message_size=64)
    q = broker.create_queue("small")
    df = spark.range(5).select(F.expr("repeat('x', 100)").cast("binary").alias("body"))
    with pytest.raises(MessageTooLarge):
        raymq.spark.send_dataframe(df, q, progress=False)


def test_a_failed_read_leaves_the_messages_in_the_queue(spark, broker, monkeypatch):
    import raydp.spark

    q = broker.create_queue("kept")
    q.send_batch([b"one", b"two", b"three"], {"color": "red"})

    def broken(*args, **kwargs):
        raise RuntimeError("Spark is gone")

    monkeypatch.setattr(raydp.spark, "ray_dataset_to_spark_dataframe", broken)
    with pytest.raises(RuntimeError, match="Spark is gone"):
        raymq.spark.read_queue(spark, q, max_messages=3, progress=False)
    stats = q.stats()
    assert stats["depth"] == 3 and stats["messages_acked"] == 0
    monkeypatch.undo()
    got = raymq.spark.read_queue(spark, q, max_messages=3, progress=False)
    assert rows_of(got, ("body", "color")) == [(b"one", "red"), (b"three", "red"), (b"two", "red")]
    assert q.stats()["depth"] == 0


def test_reading_an_empty_queue(spark, broker):
    q = broker.create_queue("empty")
    df = raymq.spark.read_queue(spark, q, timeout=0.2, progress=False)
    assert df.columns == ["offset", "timestamp", "body"] and df.count() == 0
    assert raymq.data.read_queue(q, timeout=0.2, progress=False).count() == 0


def test_property_types_are_unified_across_blocks(broker):
    q = broker.create_queue("mixed")
    q.send_batch([b"0", b"1"], [{"x": 1, "y": "a", "z": True}, {"x": 2, "y": "b"}])
    q.send_batch([b"2", b"3"], [{"x": 2.5, "y": 7}, {}])
    q.send_batch([b"4"], [{"w": None}])
    # One message per block: each block alone has its own types.
    ds = raymq.data.read_queue(q, batch_rows=1, max_messages=5, progress=False)
    rows = sorted(ds.take_all(), key=lambda r: r["offset"])
    schema = ds.schema()
    types = dict(zip(schema.names, schema.types, strict=True))
    assert types["x"] == pa.float64() and types["y"] == pa.string() and types["z"] == pa.bool_()
    assert [(r["x"], r["y"], r["z"]) for r in rows] == [
        (1.0, "a", True),
        (2.0, "b", None),
        (2.5, "7", None),
        (None, None, None),
        (None, None, None),
    ]


def test_a_late_selector_reader_waits_for_its_scan_not_for_the_timeout(broker):
    # 40 pages of blue with a few reds at the end: a reader arriving now has to scan the
    # stored properties before anything can come, which takes longer than timeout=0.
    q = broker.create_queue("late-reds", page_size_bytes=64 * 2**10)
    blue = [{"color": "blue"}] * 2_000
    for _ in range(20):
        q.send_batch([b"x" * 64] * len(blue), blue)
    reds = q.send_batch([b"red"] * 7, [{"color": "red"}] * 7)
    assert q.stats()["segment_files"] >= 20

    ds = raymq.data.read_queue(q, selector="color = 'red'", timeout=0, progress=False)
    assert sorted(r["offset"] for r in ds.take_all()) == reds
    assert q.stats()["depth"] == 40_000  # the blue ones are still there, unconsumed


def test_read_queue_waits_up_to_its_timeout_for_a_first_message(broker):
    import threading

    q = broker.create_queue("late-first")
    sender = threading.Timer(0.5, lambda: q.send_batch([b"a", b"b"]))
    sender.start()
    try:
        ds = raymq.data.read_queue(q, timeout=60, progress=False)  # returns at the arrival
    finally:
        sender.join()
    assert sorted(r["body"] for r in ds.take_all()) == [b"a", b"b"]
    assert q.stats()["depth"] == 0


def test_spark_configs_put_the_java_options_under_both_keys():
    merged = raymq.spark.spark_configs(
        {"spark.driver.extraJavaOptions": "-Dmine=1", "spark.ui.showConsoleProgress": "true"}
    )
    for key in raymq.spark.JAVA_OPTION_KEYS:
        for pkg in raymq.spark.JAVA_ADD_OPENS:
            assert f"--add-opens=java.base/{pkg}=ALL-UNNAMED" in merged[key].split()
    assert merged["spark.driver.extraJavaOptions"].endswith(" -Dmine=1")
    assert merged["spark.ui.showConsoleProgress"] == "true"  # the user's setting wins
    assert raymq.spark.spark_configs()["spark.ui.showConsoleProgress"] == "false"
    twice = raymq.spark.spark_configs(merged)
    assert twice["spark.driver.extraJavaOptions"] == merged["spark.driver.extraJavaOptions"]


INT_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]
INT_EDGES += [-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]


def random_table(rng, n: int, columns: int) -> pa.Table:
    """A body and ``columns`` property columns of every supported type, with nulls,
    msgpack's size boundaries (ints, string lengths, 15/16 map entries) and non-ASCII."""
    import numpy as np

    cols = {"body": pa.array([bytes(rng.integers(0, 256, rng.integers(0, 9))) for _ in range(n)])}
    kinds = ["str", "int", "float", "bool", "int8", "uint32", "float32", "large", "dict", "null"]
    for c in range(columns):
        kind = kinds[c % len(kinds)]
        mask = rng.random(n) < (0.0, 0.2, 0.9)[c % 3]
        if kind == "str":
            sizes = rng.choice(
                [0, 1, 31, 32, 255, 256, 65536], n, p=[0.2, 0.2, 0.2, 0.2, 0.1, 0.09, 0.01]
            )
            arr = pa.array(["é" + "x" * int(k) for k in sizes], mask=mask)
        elif kind == "int":
            arr = pa.array(
                np.where(
                    rng.random(n) < 0.5,
                    rng.choice(INT_EDGES, n),
                    rng.integers(-(2**62), 2**62, n) >> rng.integers(0, 62, n),
                ),
                mask=mask,
            )
        elif kind == "float":
            arr = pa.array(
                np.concatenate([[np.nan, -0.0], rng.normal(size=n - 2) * 1e9]), mask=mask
            )
        elif kind == "bool":
            arr = pa.array(rng.random(n) < 0.5, mask=mask)
        elif kind == "int8":
            arr = pa.array(rng.integers(-128, 128, n).astype(np.int8), mask=mask)
        elif kind == "uint32":
            arr = pa.array(rng.integers(0, 2**32, n).astype(np.uint32), mask=mask)
        elif kind == "float32":
            arr = pa.array(rng.normal(size=n).astype(np.float32), mask=mask)
        elif kind == "large":
            arr = pa.array([f"ü{i}" for i in range(n)], pa.large_string(), mask=mask)
        elif kind == "dict":
            arr = pa.array([("a", "bb")[i % 2] for i in range(n)], mask=mask).dictionary_encode()
        else:
            arr = pa.nulls(n)
        cols[f"{kind}-{c}"] = arr
    return pa.table(cols)


@pytest.mark.parametrize("columns", [0, 1, 2, 10, 15, 16, 17])
def test_encode_arrow_writes_the_bytes_from_arrow_writes(columns):
    import numpy as np

    from raymq.batch import MessageBatch

    rng = np.random.default_rng(columns)
    table = random_table(rng, 2000, columns)
    want = MessageBatch.from_arrow(table, max_message_size=2**20, queue="q")
    got = raymq.data.encode_arrow(table, max_message_size=2**20, queue="q")
    assert got.property_blobs() == want.property_blobs()
    assert np.array_equal(got.prop_offsets, want.prop_offsets)
    assert np.array_equal(got.body_offsets, want.body_offsets)
    assert got.body_data.tobytes() == want.body_data.tobytes()


def test_encode_arrow_rejects_what_from_arrow_rejects():
    from raymq.errors import InvalidProperties

    body = pa.array([b"a"])
    with pytest.raises(InvalidProperties):  # a timestamp is no property type
        raymq.data.encode_arrow(
            pa.table({"body": body, "at": pa.array([0], pa.timestamp("us"))}),
            max_message_size=100,
        )
    with pytest.raises(InvalidProperties, match="int64"):
        raymq.data.encode_arrow(
            pa.table({"body": body, "big": pa.array([2**64 - 1], pa.uint64())}),
            max_message_size=100,
        )
    with pytest.raises(MessageTooLarge):
        raymq.data.encode_arrow(pa.table({"body": pa.array([b"x" * 101])}), max_message_size=100)
    with pytest.raises(TypeError, match="body"):
        raymq.data.encode_arrow(pa.table({"x": [1]}), max_message_size=100)
