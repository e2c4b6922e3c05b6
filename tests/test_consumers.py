"""Ray tests of TargetList consumers: late arrival on a deep queue, a red message behind
paged blue ones, competing overlapping selectors, SIGKILL of a consumer's process, and
browsing a partly paged queue."""

from __future__ import annotations

import os
import signal

import ray

BLUE = {"color": "blue"}
PAGE = 64 * 1024  # small pages: the backlog spans many segment files


def fill(q, n: int, props=BLUE, body: bytes = b"b" * 200) -> None:
    for i in range(0, n, 1000):
        q.send_batch([body] * min(1000, n - i), props)


def test_late_consumer_on_a_deep_queue_starts_from_the_head(broker):
    q = broker.create_queue("deep", page_size_bytes=PAGE)
    fill(q, 20_000, props=None)
    with q.consumer(prefetch=500) as c:
        first = c.receive_batch(100, timeout=30)
        assert first.column("offset").to_pylist() == list(range(100))
        stats = c.stats()
        assert stats["high_watermark"] == 500 and stats["watermark"] <= 500
        assert stats["cache_references"] >= 20_000 - 500


def test_backlog_counts_what_a_consumer_has_not_received_yet(broker):
    q = broker.create_queue("backlog", page_size_bytes=PAGE)
    fill(q, 5_000, props={"color": "blue"})
    reds = q.send_batch([b"r"] * 30, [{"color": "red"}] * 30)
    with q.consumer(selector="color = 'red'", prefetch=100) as red, q.consumer() as plain:
        # Before any receive: scanned or not, loaded or not, all 30 reds are ahead of it.
        assert red.backlog() >= 30
        got = red.receive(max_messages=10, timeout=30)
        assert [m.offset for m in got] == reds[:10] and red.backlog() >= 20
        while red.backlog():
            got += red.receive(max_messages=100, timeout=30)
        assert [m.offset for m in got] == reds  # backlog 0 came only after the last red
        assert red.receive(timeout=0.2) == []
        assert plain.backlog() == 5_000  # the reds another consumer holds are not for it
        plain.close()  # else it may validly take the nacked reds (it has no selector)
        red.nack(got[:5])  # given back: ahead of it again
        assert red.backlog() == 5


def test_red_behind_paged_blue_for_early_and_late_consumers(broker):
    q = broker.create_queue("colors", page_size_bytes=PAGE, page_max_cache_size=1)
    with q.consumer(selector="color = 'red'", prefetch=10) as early:
        fill(q, 30_000)
        q.send(b"red-1", {"color": "red"})
        got = early.receive(timeout=30)
        assert [m.body for m in got] == [b"red-1"]
        early.ack(got)
    q.send(b"red-2", {"color": "red"})
    assert q.stats()["segment_files"] > 50  # the blue backlog is in many page files
    with q.consumer(selector="color = 'red'") as late:
        got = late.receive(timeout=30)
        assert [(m.body, m.properties) for m in got] == [(b"red-2", {"color": "red"})]
        s = late.stats()
        assert s["segments_skipped"] > 0 and s["selector"] == "color = 'red'"
    assert q.stats()["depth"] == 30_001  # no blue was consumed


def test_competing_consumers_with_overlapping_selectors(broker):
    q = broker.create_queue("overlap")
    colors = ["red", "green", "blue", "red"] * 750
    for i in range(0, len(colors), 500):
        q.send_batch(
            [b"m"] * 500, [{"color": c, "n": i + k} for k, c in enumerate(colors[i : i + 500])]
        )
    consumers = [
        q.consumer(selector="color IN ('red', 'green')", prefetch=200),
        q.consumer(selector="color <> 'green'", prefetch=200),
        q.consumer(prefetch=200),
    ]
    seen: dict[int, int] = {}
    idle = 0
    while len(seen) < len(colors) and idle < 20:
        got_any = False
        for k, c in enumerate(consumers):
            batch = c.receive_batch(150, timeout=0.2)
            for o in batch.column("offset").to_pylist():
                assert o not in seen, f"offset {o} delivered twice"
                seen[o] = k
            if batch.num_rows:
                got_any = True
                c.ack(batch)
        idle = 0 if got_any else idle + 1
    for c in consumers:
        c.close()
    assert sorted(seen) == list(range(len(colors)))
    assert {seen[o] for o in seen if colors[o] == "green"} <= {0, 2}
    assert {seen[o] for o in seen if colors[o] == "blue"} <= {1, 2}
    assert q.stats()["depth"] == 0


@ray.remote(num_cpus=0)
class ConsumerProcess:
    """A separate worker process that consumes without acknowledging."""

    def __init__(self, namespace: str, queue: str):
        import raymq

        self.q = raymq.connect(namespace=namespace).get_queue(queue)
        self.c = self.q.consumer(prefetch=50)

    def take(self, n: int) -> list[int]:
        got: list[int] = []
        while len(got) < n:
            got += [m.offset for m in self.c.receive(n - len(got), timeout=10)]
        return got

    def pid(self) -> int:
        return os.getpid()


def test_sigkill_of_a_consumer_process_redelivers_its_messages(broker):
    q = broker.create_queue("victim")
    fill(q, 100, props=None)
    worker = ConsumerProcess.remote(broker.namespace, "victim")
    taken = ray.get(worker.take.remote(30))
    assert len(taken) == 30
    os.kill(ray.get(worker.pid.remote()), signal.SIGKILL)
    with q.consumer(prefetch=100) as survivor:
        got: dict[int, int] = {}
        while len(got) < 100:
            batch = survivor.receive(100, timeout=30)
            assert batch, f"only {len(got)} of 100 came back"
            got.update((m.offset, m.delivery_count) for m in batch)
            survivor.ack(batch)
    assert sorted(got) == list(range(100))
    assert all(got[o] == 2 for o in taken)  # the dead consumer's were delivered again
    assert q.stats()["messages_redelivered"] >= 30


def test_browse_a_partly_paged_queue_changes_nothing(broker):
    q = broker.create_queue("browse", page_size_bytes=PAGE)
    fill(q, 5000)
    q.send_batch([b"r1", b"r2"], {"color": "red"})
    with q.consumer(prefetch=10) as c:
        held = c.receive(3, timeout=10)
        before = q.stats()
        everything = list(q.browse(batch_size=700))
        reds = [m.body for m in q.browse("color = 'red'")]
        after = q.stats()
        assert [m.offset for m in everything] == list(range(5002))
        assert reds == [b"r1", b"r2"]
        assert (before["depth"], before["in_flight"]) == (after["depth"], after["in_flight"])
        assert len(held) == 3
