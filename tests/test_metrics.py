"""Metrics (``raymq.metrics``): scraped from a real node's Prometheus endpoint, and the
Grafana dashboard in ``docs/grafana/raymq.json`` checked against what RayMQ exports.

The suite's session Ray has no metrics port, so the scenario runs in a child process
(this file run as a script, as ``tests/multinode_scenario.py`` is for the multi-node
tests): it starts its own Ray with ``_metrics_export_port`` and a 1 s report interval,
runs traffic, polls ``http://127.0.0.1:PORT/metrics`` until the values settle and prints
the parsed ``ray_raymq_*`` samples as JSON; the tests assert on them. Ray was started
without a namespace, and the broker has its own: the ``broker`` tag must still be the
broker's namespace.

Usage as a script: python tests/test_metrics.py PAGING_DIR RAY_TEMP_DIR
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

import pytest

from raymq.metrics import METRIC_NAMES, guard

MIB = 2**20
BROKER = "metrics-test"
DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "docs", "grafana", "raymq.json")
#: Longest the scenario waits for the metrics to show the traffic (seconds).
SETTLE_SECONDS = 60.0

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _unescape(v: str) -> str:
    """A label value as written: Prometheus escapes backslash, quote and newline."""
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], v)


def parse_prometheus(text: str, prefix: str = "ray_raymq_") -> list[dict]:
    """Samples of the Prometheus text format whose name starts with ``prefix``, as
    ``{"name", "labels", "value"}``."""
    out = []
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m[2] or "")}
        out.append({"name": m[1], "labels": labels, "value": float(m[3])})
    return out


def value(samples: list[dict], name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` (``ray_`` prefix included) whose labels
    include ``labels``; None if there is none. Several (a restarted exporter's old series
    not expired yet) count as none, so a poll waits until the picture is clear."""
    found = [
        s["value"]
        for s in samples
        if s["name"] == name and all(s["labels"].get(k) == v for k, v in labels.items())
    ]
    return found[0] if len(found) == 1 else None


# -- the scenario (child process) ------------------------------------------------------


def _scrape(port: int) -> list[dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return parse_prometheus(r.read().decode())
    except OSError:
        return []  # the metrics agent is not listening yet


def _poll(
    port: int, unmet: Callable[[list[dict]], list[str]], what: str
) -> tuple[list[dict], float]:
    """Scrape until ``unmet(samples)`` names no condition; returns the samples and the
    seconds it took."""
    t0 = time.monotonic()
    while True:
        samples = _scrape(port)
        missing = unmet(samples)
        if not missing:
            return samples, time.monotonic() - t0
        if time.monotonic() - t0 > SETTLE_SECONDS:
            raise TimeoutError(f"{what}: not seen in {SETTLE_SECONDS} s: {missing}")
        time.sleep(0.2)  # a scrape costs the agent work: poll, but not in a busy loop


def scenario(paging_dir: str, temp_dir: str) -> dict:
    """Traffic on three queues (plain, BLOCK, DROP) and one open consumer; the scraped
    samples once the metrics show it all."""
    import ray

    import raymq
    from raymq.config import apply_ray_env_defaults

    apply_ray_env_defaults()
    ray.init(  # no _metrics_export_port: the agent binds a free one itself, with no race
        _system_config={"metrics_report_interval_ms": 1000},
        include_dashboard=False,
        num_cpus=2,
        object_store_memory=100 * MIB,
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
    )
    node = ray.get_runtime_context().get_node_id()
    [port] = [n["MetricsExportPort"] for n in ray.nodes() if n["NodeID"] == node]
    assert port > 0, f"no metrics export port: {port!r}"
    out: dict = {"port": port, "node": node}
    try:
        broker = raymq.connect(
            namespace=BROKER, paging_directory=paging_dir, housekeeping_period=0.5
        )
        orders = broker.create_queue("orders")
        full = broker.create_queue("full", max_size_bytes=10_000, address_full_policy="BLOCK")
        drops = broker.create_queue("drops", max_size_bytes=10_000, address_full_policy="DROP")
        for _ in range(5):
            orders.send_batch([b"m" * 200] * 1000)
        full.send_batch([b"f" * 1000] * 9)  # 9 x 1,024 bytes counted: one more blocks
        drops.send_batch([b"d" * 1000] * 20)  # 9 fit, 11 dropped
        unblocked: list = []

        def blocked_send() -> None:  # no timeout: blocked until the ack below frees room
            unblocked.append(full.send(b"f" * 1000))

        blocked = threading.Thread(target=blocked_send, daemon=True)
        blocked.start()
        consumer = orders.consumer(prefetch=500)
        got, deadline = 0, time.monotonic() + SETTLE_SECONDS
        while got < 2000:  # 3,000 more stay: an empty receive is only a slow one
            batch = consumer.receive_batch(min(500, 2000 - got), timeout=1)
            if batch.num_rows:
                consumer.ack(batch)
                got += batch.num_rows
            elif time.monotonic() > deadline:
                raise TimeoutError(f"received {got} of 2000 in {SETTLE_SECONDS} s")
        out["consumer"] = cid = consumer.consumer_id
        # Taken from the TargetList (its handed_out) for a receive, not returned yet.
        out["client_buffered"] = buffered = consumer.stats()["client_buffered"]
        q = {"broker": BROKER, "queue": "orders"}

        def settled(s: list[dict]) -> list[str]:
            """What the tests read and this one scrape does not show yet (empty: all of
            it): each exporter reports on its own, so one scrape may hold some of them
            and not others."""
            depth, held = (
                value(s, "ray_raymq_queue_depth", **q),
                value(s, "ray_raymq_queue_in_flight", **q),
            )
            lag = value(s, "ray_raymq_consumer_lag", consumer=cid, **q)
            threshold = value(s, "ray_raymq_governor_threshold_bytes", broker=BROKER) or 0
            handed_out = value(s, "ray_raymq_consumer_handed_out", consumer=cid, **q)
            acked = value(s, "ray_raymq_consumer_acked", consumer=cid, **q)
            shares = [
                value(s, "ray_raymq_governor_queue_share_bytes", broker=BROKER, queue=name)
                for name in ("orders", "full", "drops")
            ]
            checks = {
                "every metric name": {"ray_" + n for n in METRIC_NAMES} <= {x["name"] for x in s},
                f"shares {shares} > 0": all(x is not None and x > 0 for x in shares),
                f"shares within threshold {threshold}": sum(x or 0 for x in shares) <= threshold,
                f"depth {depth} == 3000": depth == 3000,
                "messages_in == 5000": value(s, "ray_raymq_queue_messages_in", **q) == 5000,
                "messages_acked == 2000": value(s, "ray_raymq_queue_messages_acked", **q) == 2000,
                f"lag {lag} == depth - in_flight {held}": held is not None and lag == depth - held,
                "watermark": value(s, "ray_raymq_consumer_watermark", consumer=cid, **q)
                is not None,
                f"handed_out {handed_out} == 2000 + {buffered}": handed_out == 2000 + buffered,
                f"consumer acked {acked} == 2000": acked == 2000,
                "full: blocked_producers == 1": value(
                    s, "ray_raymq_queue_blocked_producers", queue="full"
                )
                == 1,
                "drops: messages_dropped == 11": value(
                    s, "ray_raymq_queue_messages_dropped", queue="drops"
                )
                == 11,
                "governor direct bytes > 0": (
                    value(s, "ray_raymq_governor_consumer_direct_bytes", consumer=cid) or 0
                )
                > 0,
                "threshold > 0": threshold > 0,
            }
            return [name for name, ok in checks.items() if not ok]

        out["samples"], out["settle_seconds"] = _poll(port, settled, "traffic")
        # a BLOCKed producer goes when an ack frees room
        with full.consumer(prefetch=1) as c:
            freed, deadline = [], time.monotonic() + SETTLE_SECONDS
            while not freed:  # the queue holds 9 messages: one comes, however late
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing received from 'full' in {SETTLE_SECONDS} s")
                freed = c.receive(1, timeout=1)
            c.ack(freed)
            blocked.join(timeout=SETTLE_SECONDS)
            if blocked.is_alive():
                raise TimeoutError(f"the BLOCKed send still waits {SETTLE_SECONDS} s after an ack")
        out["unblocked_offset"] = unblocked[0] if unblocked else None
        out["unblocked"], _ = _poll(
            port,
            lambda s: (
                []
                if value(s, "ray_raymq_queue_blocked_producers", queue="full") == 0
                else ["full: blocked_producers == 0"]
            ),
            "unblocked",
        )
        consumer.close()
        broker.shutdown()
    finally:
        ray.shutdown()
    return out


# -- the tests --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> dict:
    paging = tmp_path_factory.mktemp("paging")
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, __file__, str(paging), str(temp)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["wall_seconds"] = time.monotonic() - t0
    return out


def test_queue_metrics(observed):
    s, q = observed["samples"], {"broker": BROKER, "queue": "orders", "node": observed["node"]}
    assert value(s, "ray_raymq_queue_depth", **q) == 3000
    assert value(s, "ray_raymq_queue_messages_in", **q) == 5000
    assert value(s, "ray_raymq_queue_messages_acked", **q) == 2000
    assert value(s, "ray_raymq_queue_messages_out", **q) >= 2000
    assert value(s, "ray_raymq_queue_consumers", **q) == 1
    assert value(s, "ray_raymq_queue_segment_files", **q) >= 1
    assert value(s, "ray_raymq_queue_bytes_on_disk", **q) > 5000 * 200
    assert 3000 * 200 <= value(s, "ray_raymq_queue_bytes_queued", **q) < 5000 * 300
    assert value(s, "ray_raymq_queue_head_cache_bytes", **q) >= 0
    assert value(s, "ray_raymq_queue_index_bytes", **q) > 0
    assert value(s, "ray_raymq_queue_messages_dropped", **q) == 0


def test_consumer_metrics(observed):
    s, cid = observed["samples"], observed["consumer"]
    c = {"broker": BROKER, "queue": "orders", "consumer": cid, "node": observed["node"]}
    assert value(s, "ray_raymq_consumer_high_watermark", **c) == 500
    watermark = value(s, "ray_raymq_consumer_watermark", **c)
    assert 0 <= watermark <= 500
    assert value(s, "ray_raymq_consumer_direct_bytes", **c) >= watermark * 200
    assert value(s, "ray_raymq_consumer_pending_cache_bytes", **c) >= 0
    assert value(s, "ray_raymq_consumer_handed_out", **c) == 2000 + observed["client_buffered"]
    assert value(s, "ray_raymq_consumer_acked", **c) == 2000
    held = value(s, "ray_raymq_consumer_held", **c)
    assert value(s, "ray_raymq_consumer_lag", **c) == 3000 - held


def test_governor_metrics(observed):
    s, node, cid = observed["samples"], observed["node"], observed["consumer"]
    threshold = value(s, "ray_raymq_governor_threshold_bytes", broker=BROKER)
    assert threshold > 0
    assert (
        value(s, "ray_raymq_governor_node_threshold_bytes", broker=BROKER, node=node) == threshold
    )
    shares = [
        value(s, "ray_raymq_governor_queue_share_bytes", broker=BROKER, queue=q, node=node)
        for q in ("orders", "full", "drops")
    ]
    assert all(x > 0 for x in shares) and sum(shares) <= threshold
    direct = value(s, "ray_raymq_governor_consumer_direct_bytes", queue="orders", consumer=cid)
    assert direct > 0
    assert value(s, "ray_raymq_governor_rounds", broker=BROKER) >= 1


def test_blocked_producers_and_drops(observed):
    s, u = observed["samples"], observed["unblocked"]
    assert value(s, "ray_raymq_queue_blocked_producers", broker=BROKER, queue="full") == 1
    assert value(s, "ray_raymq_queue_blocked_seconds", broker=BROKER, queue="full") > 0
    assert value(u, "ray_raymq_queue_blocked_producers", broker=BROKER, queue="full") == 0
    assert observed["unblocked_offset"] == 9  # stored once room was made, after the 9
    assert value(s, "ray_raymq_queue_messages_dropped", broker=BROKER, queue="drops") == 11
    assert value(s, "ray_raymq_queue_depth", broker=BROKER, queue="drops") == 9


def test_every_metric_is_exported_with_its_tags(observed):
    s = observed["samples"]
    seen = {x["name"] for x in s}
    missing = {"ray_" + n for n in METRIC_NAMES} - seen
    assert not missing
    for x in s:
        labels = x["labels"]
        assert labels["broker"] == BROKER, x  # the broker's namespace, not the job's
        assert labels.get("node", observed["node"]) == observed["node"], x
        if x["name"].startswith("ray_raymq_queue_"):
            assert labels["queue"] in ("orders", "full", "drops"), x
        if x["name"].startswith("ray_raymq_consumer_"):
            assert labels["queue"] and labels["consumer"], x
    print(
        f"settled after {observed['settle_seconds']:.1f} s; wall {observed['wall_seconds']:.1f} s"
    )


# -- the Grafana dashboard and the exporters without Ray ----------------------------------


def _panels(panels: list[dict]):
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # collapsed rows hold their panels


def test_grafana_dashboard_queries_name_exported_metrics():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exported = {"ray_" + n for n in METRIC_NAMES}
    queries = []
    for p in _panels(dashboard["panels"]):
        if p.get("type") == "row":
            continue
        assert p["datasource"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        queries += [(p["title"], t["expr"]) for t in p["targets"]]
    for v in dashboard["templating"]["list"]:
        if v.get("type") == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            queries.append((v["name"], query))
    assert len(queries) >= 10
    for title, expr in queries:
        names = set(re.findall(r"\bray_raymq_[a-z0-9_]+", expr))
        assert names, (title, expr)
        assert names <= exported, (title, names - exported)
    ds = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert dashboard["uid"]


class _Recorder:
    """Stands in for a ``ray.util.metrics.Gauge`` (the exporters without Ray)."""

    def __init__(self, name: str, sets: list):
        self.name, self.sets = name, sets

    def set(self, v: float, tags: dict[str, str]) -> None:
        self.sets.append((self.name, tags, v))


@pytest.fixture
def recorded(monkeypatch) -> list:
    import raymq.metrics as m

    sets: list = []
    monkeypatch.setattr(m, "_gauge", lambda name: _Recorder(name, sets))
    return sets


def test_export_governor_tags_each_level(recorded):
    from raymq.metrics import export_governor

    plan = {
        "threshold": 100,
        "node_thresholds": {"n1": 60, "n2": 40},
        "node_totals": {"n1": 50, "n2": 0},
        "queues": {
            "q": {
                "node_id": "n1",
                "share": 50,
                "index_bytes": 5,
                "direct": {"c": 20},
                "pending": {"c": 10},
                "queue_bytes": 15,
            }
        },
    }
    export_governor({"rounds": 3, "round_seconds": 0.01, "plan": plan}, "b")
    got = {(n, tuple(sorted(t.items()))): v for n, t, v in recorded}
    assert got[("raymq_governor_threshold_bytes", (("broker", "b"),))] == 100
    assert got[("raymq_governor_node_threshold_bytes", (("broker", "b"), ("node", "n2")))] == 40
    q = (("broker", "b"), ("node", "n1"), ("queue", "q"))
    assert got[("raymq_governor_queue_cache_bytes", q)] == 15
    c = tuple(sorted((*q, ("consumer", "c"))))
    assert got[("raymq_governor_consumer_pending_bytes", c)] == 10
    recorded.clear()
    export_governor({"rounds": 0, "round_seconds": 0.0, "plan": None}, "b")
    assert [n for n, _t, _v in recorded] == [
        "raymq_governor_rounds",
        "raymq_governor_round_seconds",
    ]


def test_export_queue_sets_what_a_snapshot_has(recorded):
    from raymq.metrics import export_queue

    export_queue({"name": "q", "depth": 7, "flowing_to_disk": True, "bytes_in": 70}, "n", "b")
    got = {n: v for n, _t, v in recorded}
    assert got == {
        "raymq_queue_depth": 7,
        "raymq_queue_flowing_to_disk": 1,
        "raymq_queue_bytes_in": 70,
    }
    assert all(t == {"broker": "b", "queue": "q", "node": "n"} for _n, t, _v in recorded)


def test_guard_logs_and_swallows(caplog):
    with guard("test"):
        raise RuntimeError("boom")
    assert "metrics export for test failed" in caplog.text
    with pytest.raises(KeyboardInterrupt), guard("test"):
        raise KeyboardInterrupt


if __name__ == "__main__":
    print(json.dumps(scenario(sys.argv[1], sys.argv[2])))
