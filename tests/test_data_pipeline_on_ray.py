"""Ray Data pipelines on a real local Ray: ``QueueReader`` (leased, read in parallel,
acknowledged on commit) and ``QueueDatasink`` (each row once), and a pipeline whose
driver is SIGKILLed before its commit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow as pa
import pytest
import ray

from raymq.data import QueueDatasink, QueueReader
from raymq.errors import ConsumerClosed, InvalidSetting
from tests.readme_blocks import run_readme_block

#: Bound on the queue noticing a dead reader (seconds): a wedge fails, not a timing.
DEATH_NOTICE_DEADLINE = 60.0


def _fill(q, n: int, **props) -> list[int]:
    bodies = [b"m%d" % i for i in range(n)]
    return q.send_batch(bodies, [{"i": i, **props} for i in range(n)])


def test_a_reader_holds_its_lease_and_commits_exactly_what_was_read(broker):
    q = broker.create_queue("lease")
    _fill(q, 500)
    reader = QueueReader(q, max_messages=300, batch_rows=64, progress=False)
    ds = reader.dataset()
    assert reader.leased == 300
    # Held: a consumer gets only what the reader did not lease.
    other = q.consumer(prefetch=1000)
    got = []
    while len(got) < 200:
        got += [m.offset for m in other.receive(500, timeout=5.0)]
    assert sorted(got) == list(range(300, 500))
    other.close()  # what it got goes back
    rows = ds.take_all()
    assert sorted(r["offset"] for r in rows) == list(range(300))
    assert sorted(r["i"] for r in rows) == list(range(300))
    assert reader.commit() == 300
    stats = q.stats()
    assert stats["depth"] == 200 and stats["in_flight"] == 0
    with pytest.raises(ConsumerClosed):
        reader.commit()


def test_a_dataset_has_one_block_per_batch_rows_messages(broker):
    # Ray Data, asked for no block count, splits a few tasks' output into 200 slivers.
    q = broker.create_queue("blocks")
    _fill(q, 350)
    with QueueReader(q, batch_rows=100, progress=False) as reader:
        ds = reader.dataset().materialize()
        sizes = sorted(ray.get(b).num_rows for b in ds.to_arrow_refs())
        assert sum(sizes) == 350 and len(sizes) == 4 and max(sizes) <= 100, sizes
        reader.commit()
    assert q.stats()["depth"] == 0


def test_commit_gives_back_what_the_dataset_never_read_and_abort_gives_all(broker):
    q = broker.create_queue("partial")
    _fill(q, 100)
    reader = QueueReader(q, batch_rows=10, progress=False)
    ds = reader.dataset(parallelism=10)
    first = ds.limit(10).take_all()  # Ray Data reads only the blocks it needs
    assert len(first) == 10
    acked = reader.commit()
    assert 10 <= acked < 100
    assert q.stats()["depth"] == 100 - acked
    left = sorted(m.properties["i"] for m in q.browse())
    assert len(left) == 100 - acked and not set(left) & {r["i"] for r in first}
    with QueueReader(q, selector="i >= 50", progress=False) as r2:
        got = sorted(x["i"] for x in r2.dataset().take_all())
    assert got == [i for i in left if i >= 50]
    # Left without commit: aborted, all given back, their delivery not counted.
    stats = q.stats()
    assert stats["depth"] == 100 - acked and stats["in_flight"] == 0
    assert all(m.delivery_count == 0 for m in q.browse() if m.properties["i"] >= 50)


def test_the_sink_stores_each_row_once_when_written_again(broker):
    q = broker.create_queue("sink")
    table = pa.table({"body": [b"r%d" % i for i in range(1000)], "k": list(range(1000))})
    ds = ray.data.from_arrow(table).repartition(4)
    sink = QueueDatasink(q, id_column="k", id_prefix="rows:")
    ds.write_datasink(sink)
    assert sink.rows_written == 1000
    ds.write_datasink(QueueDatasink(q, id_column="k", id_prefix="rows:"))  # a rerun
    stats = q.stats()
    assert stats["depth"] == 1000 and stats["duplicates_dropped"] == 1000
    bodies = sorted(m.body for m in q.browse())
    assert bodies == sorted(b"r%d" % i for i in range(1000))
    with pytest.raises(Exception, match="id_column='nope'"):
        ds.write_datasink(QueueDatasink(q, id_column="nope"))


def test_bad_reader_settings_are_refused(broker):
    q = broker.create_queue("bad-reader")
    for bad in ({"max_messages": 0}, {"batch_rows": 0}, {"max_messages": True}):
        with pytest.raises(InvalidSetting):
            QueueReader(q, **bad)


DRIVER = textwrap.dedent(
    """
    import sys, numpy as np, raymq
    from raymq.data import QueueReader, QueueDatasink

    address, namespace, stop = sys.argv[1], sys.argv[2], sys.argv[3] == "stop"
    broker = raymq.connect(address=address, namespace=namespace, create=False)
    src, dst = broker.get_queue("events"), broker.get_queue("enriched")
    reader = QueueReader(src, batch_rows=500, progress=False)

    def enrich(batch):
        batch["body"] = np.array([b + b"!" for b in batch["body"]], dtype=object)
        return batch

    ds = reader.dataset().map_batches(enrich, batch_format="numpy")
    ds.write_datasink(QueueDatasink(dst, id_column="offset", id_prefix="events:"))
    print("WRITTEN", reader.leased, flush=True)
    if stop:
        sys.stdin.read()  # killed here, before commit()
    print("COMMITTED", reader.commit(), flush=True)
    """
)


def _driver(tmp_path, address: str, namespace: str, stop: bool) -> subprocess.Popen:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    return subprocess.Popen(
        [sys.executable, str(script), address, namespace, "stop" if stop else "go"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )


def _said(driver: subprocess.Popen, word: str) -> str:
    """The driver's first line starting with ``word`` (Ray's own log lines, on the
    same stdout, skipped); "" if it ended without one."""
    for line in driver.stdout:
        if line.startswith(word):
            return line
    return ""


def test_a_pipeline_whose_driver_dies_before_commit_loses_nothing(broker, tmp_path):
    n = 3000
    src = broker.create_queue("events")
    dst = broker.create_queue("enriched")
    _fill(src, n)
    address = ray.get_runtime_context().gcs_address

    first = _driver(tmp_path, address, broker.namespace, stop=True)
    line = _said(first, "WRITTEN")
    assert line.split() == ["WRITTEN", str(n)], line
    assert src.stats()["in_flight"] == n  # leased by the first driver
    os.kill(first.pid, signal.SIGKILL)
    first.wait()

    # The lease actor dies with its driver; the queue gives everything back.
    deadline = time.monotonic() + DEATH_NOTICE_DEADLINE
    while src.stats()["in_flight"]:
        assert time.monotonic() < deadline, "the dead reader's lease was never given back"
        time.sleep(0.1)
    assert src.stats()["depth"] == n

    again = _driver(tmp_path, address, broker.namespace, stop=False)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and f"COMMITTED {n}" in out, out
    assert src.stats()["depth"] == 0
    stats = dst.stats()
    assert stats["depth"] == n and stats["duplicates_dropped"] == n
    bodies = sorted(m.body for m in dst.browse(batch_size=5000))
    assert bodies == sorted(b"m%d!" % i for i in range(n))
    ids = {m.properties["_AMQ_DUPL_ID"] for m in dst.browse(batch_size=5000)}
    assert ids == {f"events:{i}" for i in range(n)}
    assert np.all(np.diff(sorted(m.offset for m in dst.browse(batch_size=5000))) == 1)


def test_the_readme_pipeline_runs_as_typed(broker, monkeypatch):
    """README.md's ``python data-pipeline`` block, run as written (``raymq.connect``
    gives this test's broker)."""
    scope = run_readme_block("python data-pipeline", broker, monkeypatch)
    assert scope["clicks"].stats()["depth"] == 0
    got = sorted(m.body for m in scope["enriched"].browse(batch_size=2000))
    assert got == sorted(b"CLICK-%d" % i for i in range(1000))
    assert {m.properties["page"] for m in scope["enriched"].browse()} == {"home"}


def test_a_lease_that_fails_half_way_gives_back_what_it_took(broker, monkeypatch):
    import raymq.queue_reader
    from raymq.errors import BrokerUnavailable

    q = broker.create_queue("half-lease")
    _fill(q, 50)
    monkeypatch.setattr(raymq.queue_reader, "LEASE_CHUNK", 20)
    real = q._invoke
    calls = []

    def failing(method, *args, **kwargs):
        if method == "lease":
            calls.append(method)
            if len(calls) == 2:
                raise BrokerUnavailable("queue 'half-lease' went away (test)")
        return real(method, *args, **kwargs)

    monkeypatch.setattr(q, "_invoke", failing)
    reader = QueueReader(q, progress=False)
    with pytest.raises(BrokerUnavailable, match="half-lease"):
        reader.dataset()
    stats = q.stats()
    assert stats["in_flight"] == 0 and stats["depth"] == 50
    with pytest.raises(ConsumerClosed):
        reader.commit()
