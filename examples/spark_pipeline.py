"""Spark pipeline: a DataFrame of events into a queue, consumers with selectors, results
back in Spark.

10,000 shop events (views, clicks, purchases from three regions) go from a Spark
DataFrame into a durable queue; their columns become message properties. A fraud check
takes the big purchases with a plain RayMQ consumer and raises alerts on a second queue;
Spark reads the EU purchases and the alerts back as DataFrames and aggregates them; the
remaining events become a Ray Dataset. Spark on Ray (RayDP) is started by RayMQ, with
the JVM options Java 17 needs.

``python examples/spark_pipeline.py`` runs it on an embedded local Ray of its own;
``ray job submit --working-dir examples -- python spark_pipeline.py`` (or ``--join``)
joins the running broker and leaves its queues ``example.shop_events`` and
``example.fraud_alerts`` there, drained. Java 17 must be on the node that runs it.
"""

from __future__ import annotations

from collections import Counter

from _common import example_broker

import raymq.data
import raymq.spark

EVENTS = 10_000


def make_events(spark):
    """EVENTS rows: a JSON body and the properties kind, region, user and amount (only
    purchases have one). Derived from a hash of the id: the same data on every run."""
    from pyspark.sql import functions as F

    h = F.abs(F.hash("id"))
    kind = F.element_at(F.array(F.lit("view"), F.lit("click"), F.lit("purchase")), h % 3 + 1)
    return spark.range(EVENTS).select(
        F.to_json(F.struct("id")).cast("binary").alias("body"),
        kind.alias("kind"),
        F.element_at(F.array(F.lit("eu"), F.lit("us"), F.lit("apac")), h % 7 % 3 + 1).alias(
            "region"
        ),
        (h % 50).alias("user"),
        F.when(kind == "purchase", (h % 10_000) / 100.0).alias("amount"),
    )


def fraud_check(events, alerts) -> int:
    """Big purchases, taken with a selector, become alerts; returns how many."""
    n = 0
    with events.consumer(selector="kind = 'purchase' AND amount > 90", prefetch=1000) as c:
        while True:
            batch = c.receive(max_messages=1000, timeout=1)
            if not batch:
                if c.backlog() == 0:  # nothing more for this selector in the queue
                    break
                continue
            alerts.send_batch(
                [m.body for m in batch],
                [{k: m.properties[k] for k in ("user", "region", "amount")} for m in batch],
            )
            c.ack(batch)
            n += len(batch)
    return n


def main() -> None:
    with example_broker("spark-example") as example:
        broker = example.broker
        print("starting Spark on Ray ...")
        spark = raymq.spark.init_spark(app_name="raymq-spark-example")
        spark.sparkContext.setLogLevel("ERROR")
        try:
            run(spark, broker)
        finally:
            raymq.spark.stop_spark()


def run(spark, broker) -> None:
    events = broker.create_queue("example.shop_events")
    alerts = broker.create_queue("example.fraud_alerts")
    df = make_events(spark)
    want = {r["kind"]: r["count"] for r in df.groupBy("kind").count().collect()}
    sent = raymq.spark.send_dataframe(df, events)
    print(f"sent {sent} events from Spark; queue depth {events.stats()['depth']}")

    flagged = fraud_check(events, alerts)
    print(f"fraud check: {flagged} purchases over 90 raised alerts")

    eu = raymq.spark.read_queue(spark, events, selector="kind = 'purchase' AND region = 'eu'")
    print(f"Spark read {eu.count()} EU purchases (the big ones went to the fraud check):")
    eu.groupBy("user").sum("amount").orderBy("sum(amount)", ascending=False).show(3)

    per_region = raymq.spark.read_queue(spark, alerts).groupBy("region").count()
    print("alerts per region, in Spark:")
    per_region.orderBy("region").show()

    rest = raymq.data.read_queue(events)  # views, clicks, the other purchases
    kinds = Counter(row["kind"] for row in rest.iter_rows())
    print(f"the remaining {rest.count()} events as a Ray Dataset {rest.schema().names}:")
    print(f"  {dict(sorted(kinds.items()))}")

    assert sent == EVENTS and flagged + eu.count() + rest.count() == EVENTS
    assert kinds["view"] == want["view"] and kinds["click"] == want["click"]
    assert events.stats()["depth"] == 0 and alerts.stats()["depth"] == 0
    print("every event consumed exactly once; both queues are empty")


if __name__ == "__main__":
    main()
