"""Spark DataFrames to and from a queue through Spark on Ray (RayDP), against RayDP alone.

A DataFrame of ``--rows`` rows (a ``--body-bytes`` binary body, a string and a double
column that become properties) goes into a durable queue with
``raymq.spark.send_dataframe`` and comes back with ``raymq.spark.read_queue`` (consumed,
acknowledged, materialized in Spark). Baselines measured in the same run, on the same
rows and the same Spark on Ray session:

- Spark -> Ray: ``ray.data.from_spark`` alone (the blocks materialized in the object
  store), the part of ``send_dataframe`` that is RayDP's; also the yardstick for
  ``raymq.data.read_queue`` (queue -> Ray Dataset, consumed and acknowledged);
- Ray -> Spark: the same rows as Arrow blocks in the object store handed to Spark by
  RayDP and materialized (``localCheckpoint``), the part of ``read_queue`` that is
  RayDP's. (``Dataset.to_spark`` fails on string columns with pandas 3.)

A warm-up round on 10,000 rows first starts the JVMs' and Ray's workers, so no figure
pays for that. The bridge should cost little beyond RayDP itself.

    python -m bench.spark [--rows 2000000] [--body-bytes 100] [--partitions 4]
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import pyarrow as pa
import ray

import raymq
import raymq.data
import raymq.spark
from bench.common import console, print_table, start_broker, stop_broker

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

COLORS = ("red", "green", "blue")


def events(spark: SparkSession, rows: int, body_bytes: int, partitions: int) -> DataFrame:
    """``rows`` rows: a binary body of ``body_bytes`` bytes, a color and an amount."""
    from pyspark.sql import functions as F

    return spark.range(0, rows, numPartitions=partitions).select(
        F.rpad(F.format_string("event-%d-", "id"), body_bytes, "x").cast("binary").alias("body"),
        F.element_at(F.array(*[F.lit(c) for c in COLORS]), (F.col("id") % 3 + 1).cast("int")).alias(
            "color"
        ),
        (F.col("id") * 0.25).alias("amount"),
    )


def spark_to_ray(df: DataFrame) -> int:
    """Baseline: ``ray.data.from_spark`` with its blocks in the object store; returns rows."""
    from raydp.spark import release_spark_recoverable

    ds = ray.data.from_spark(df)
    rows = ds.count()
    release_spark_recoverable(df)
    return rows


def ray_to_spark(spark: SparkSession, tables: list[pa.Table]) -> tuple[int, float]:
    """Baseline: Arrow blocks already in the object store into a materialized Spark
    DataFrame, as ``read_queue`` does once it has drained the queue; returns (rows,
    seconds), the seconds from the blocks being in the object store."""
    from raydp.spark import ray_dataset_to_spark_dataframe

    refs = [ray.put(t) for t in tables]
    t0 = time.perf_counter()
    blocks = [ray.put(raymq.spark._ipc_bytes(ray.get(r))) for r in refs]
    df = ray_dataset_to_spark_dataframe(spark, tables[0].schema, blocks)
    df = df.localCheckpoint(eager=True)
    seconds = time.perf_counter() - t0  # as read_queue's figure: materialized, not counted
    del refs
    return df.count(), seconds


def queue_tables(rows: int, body_bytes: int, batch_rows: int) -> list[pa.Table]:
    """The rows as read_queue's drain would hold them: offset, timestamp, body, color,
    amount, in blocks of ``batch_rows`` (built in Python, outside the timing)."""
    out = []
    for start in range(0, rows, batch_rows):
        ids = range(start, min(rows, start + batch_rows))
        out.append(
            pa.table(
                {
                    "offset": pa.array(ids, pa.int64()),
                    "timestamp": pa.array([i * 10 for i in ids], pa.timestamp("us", tz="UTC")),
                    "body": pa.array(
                        [f"event-{i}-".encode().ljust(body_bytes, b"x") for i in ids], pa.binary()
                    ),
                    "color": pa.array([COLORS[i % 3] for i in ids]),
                    "amount": pa.array([i * 0.25 for i in ids]),
                }
            )
        )
    return out


def rate(rows: int, seconds: float) -> float:
    """Rows per second."""
    return rows / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the DataFrame")
    parser.add_argument("--body-bytes", type=int, default=100, help="bytes of each body")
    parser.add_argument("--partitions", type=int, default=4, help="Spark partitions")
    parser.add_argument(
        "--batch-rows", type=int, default=raymq.spark.DEFAULT_SEND_ROWS, help="rows per send"
    )
    args = parser.parse_args()

    broker = start_broker(namespace="raymq-bench-spark")
    try:
        console.print("starting Spark on Ray ...")
        spark = raymq.spark.init_spark(app_name="raymq-bench")
        spark.sparkContext.setLogLevel("ERROR")
        q = broker.create_queue("bench-spark")

        console.print("warm-up on 10,000 rows ...")
        small = events(spark, 10_000, args.body_bytes, args.partitions)
        spark_to_ray(small)
        raymq.spark.send_dataframe(small, q, batch_rows=args.batch_rows, progress=False)
        raymq.data.read_queue(q, max_messages=10_000, progress=False).count()
        raymq.spark.send_dataframe(small, q, batch_rows=args.batch_rows, progress=False)
        raymq.spark.read_queue(spark, q, max_messages=10_000, progress=False).count()
        ray_to_spark(spark, queue_tables(10_000, args.body_bytes, 5_000))

        df = events(spark, args.rows, args.body_bytes, args.partitions)
        console.print(f"Spark -> Ray: ray.data.from_spark alone, {args.rows:,} rows ...")
        t0 = time.perf_counter()
        assert spark_to_ray(df) == args.rows
        base_in = rate(args.rows, time.perf_counter() - t0)

        console.print("Spark -> queue: raymq.spark.send_dataframe ...")
        t0 = time.perf_counter()
        sent = raymq.spark.send_dataframe(df, q, batch_rows=args.batch_rows)
        rmq_in = rate(args.rows, time.perf_counter() - t0)
        assert sent == args.rows and q.stats()["depth"] == args.rows

        console.print("queue -> Ray Dataset: raymq.data.read_queue (consume, ack) ...")
        t0 = time.perf_counter()
        ds = raymq.data.read_queue(q, max_messages=args.rows)
        rmq_ds = rate(args.rows, time.perf_counter() - t0)
        assert ds.count() == args.rows and q.stats()["depth"] == 0
        del ds

        console.print("again into the queue (not timed) ...")
        raymq.spark.send_dataframe(df, q, batch_rows=args.batch_rows, progress=False)
        console.print("queue -> Spark: raymq.spark.read_queue (consume, ack, materialize) ...")
        t0 = time.perf_counter()
        back = raymq.spark.read_queue(spark, q, max_messages=args.rows)
        rmq_out = rate(args.rows, time.perf_counter() - t0)
        assert back.count() == args.rows and q.stats()["depth"] == 0
        back.unpersist()
        del back

        console.print("Ray -> Spark: RayDP alone on the same rows as Arrow blocks ...")
        tables = queue_tables(args.rows, args.body_bytes, 50_000)
        rows, seconds = ray_to_spark(spark, tables)
        assert rows == args.rows
        base_out = rate(rows, seconds)
        del tables

        print_table(
            f"{args.rows:,} rows ({args.body_bytes} B body + 2 properties),"
            f" {args.partitions} Spark partitions, {time.strftime('%Y-%m-%d')}",
            ["measure", "RayMQ rows/s", "target rows/s", "target", "ratio"],
            [
                [
                    "Spark -> queue (send_dataframe)",
                    f"{rmq_in:,.0f}",
                    f"{base_in:,.0f}",
                    "from_spark alone",
                    f"{rmq_in / base_in:.2f}x",
                ],
                [
                    "queue -> Ray Dataset (data.read_queue)",
                    f"{rmq_ds:,.0f}",
                    f"{base_in:,.0f}",
                    "from_spark alone",
                    f"{rmq_ds / base_in:.2f}x",
                ],
                [
                    "queue -> Spark (read_queue)",
                    f"{rmq_out:,.0f}",
                    f"{base_out:,.0f}",
                    "RayDP Ray->Spark",
                    f"{rmq_out / base_out:.2f}x",
                ],
            ],
        )
        broker.delete_queue("bench-spark")
    finally:
        raymq.spark.stop_spark()
        stop_broker(broker)


if __name__ == "__main__":
    main()
