"""The ``raymq`` command, run in-process against the session's real Ray.

(``tests/test_cli_process.py`` runs the installed script in a subprocess: what reaches
stdout and stderr, and how fast an unreachable address fails.)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import threading
import time
import uuid

import pytest

import raymq
from raymq import cli
from raymq.cli import BYTES, main
from tests.jobs_scenario import readme_block
from tests.module_broker import ModuleBroker

#: Generous bound on a command that must not wait out its --timeout (seconds; a loaded
#: machine can be slow); the timeouts given are twice this, so passing proves the
#: command did not wait them out, and a failing run is the only slow one.
PROMPT = 300.0


def _cli_start(namespace: str, paging_directory: str) -> raymq.Broker:
    """``raymq start`` of a broker; returns a handle to it."""
    args = ["start", "--paging-directory", paging_directory, "--housekeeping-period", "0.5"]
    assert main(["--namespace", namespace, *args]) == 0
    return raymq.connect(namespace=namespace, create=False, warm=False)


@pytest.fixture(scope="module")
def _cli_broker(ray_session, tmp_path_factory):
    shared = ModuleBroker(
        lambda: tmp_path_factory.mktemp("paging"),
        start=_cli_start,
        stop=lambda b: main(["--namespace", b.namespace, "stop"]),
    )
    yield shared
    shared.close()


@pytest.fixture
def ns(_cli_broker):
    """A namespace with a broker started by ``raymq start`` (shared by the module's
    tests, emptied after each; started again after a test that stops it)."""
    yield _cli_broker.get().namespace
    _cli_broker.empty()


def paging_directory_of(ns: str) -> str:
    """The paging directory of the broker running in ``ns``."""
    return raymq.connect(namespace=ns, create=False, warm=False).config.paging_directory


def run(capsys, ns: str, *args: str) -> tuple[int, str, str]:
    code = main(["--namespace", ns, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def ok(capsys, ns: str, *args: str) -> str:
    """Run a command that must succeed; returns its stdout."""
    code, out, err = run(capsys, ns, *args)
    assert code == 0, err
    return out


def one_error_line(err: str) -> str:
    """The single line of an error; fails if there is more or a traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("raymq: error: "), err
    return lines[0]


def status_json(capsys, ns: str) -> dict:
    code, out, err = run(capsys, ns, "status", "--json")
    assert code == 0, err
    return json.loads(out)


def test_create_send_consume_status_stop(ns, capsys):
    assert (
        run(
            capsys,
            ns,
            "create-queue",
            "orders",
            "--max-size-bytes",
            "1MiB",
            "--address-full-policy",
            "FAIL",
        )[0]
        == 0
    )
    out = ok(capsys, ns, "send", "orders", "one", "two", "-p", "color=red", "-p", "n=3")
    assert "sent 2 message(s)" in out
    ok(capsys, ns, "send", "orders", "--count", "100", "--size", "1KiB")

    status = status_json(capsys, ns)
    q = status["queues"]["orders"]
    assert q["depth"] == 102 and q["address_full_policy"] == "FAIL"
    assert q["max_size_bytes"] == 2**20 and "plan" in status["governor"]
    out = ok(capsys, ns, "status")
    assert "orders" in out and "FAIL" in out and "MemoryGovernor" in out

    out = ok(capsys, ns, "consume", "orders", "--selector", "color = 'red'", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [m["body"] for m in lines] == ["one", "two"]
    assert lines[0]["properties"] == {"color": "red", "n": 3} and lines[0]["offset"] == 0
    out = ok(capsys, ns, "consume", "orders", "-n", "5", "--no-ack", "--timeout", "2")
    assert len([x for x in out.splitlines() if "\t" in x]) == 5
    assert status_json(capsys, ns)["queues"]["orders"]["depth"] == 100  # only the red two acked


def test_no_ack_prints_each_message_once(ns, capsys):
    """--no-ack gives messages back only at the end: with fewer messages than -n, none
    comes round twice."""
    ok(capsys, ns, "create-queue", "few")
    ok(capsys, ns, "send", "few", "a", "b")
    out = ok(capsys, ns, "consume", "few", "-n", "5", "--no-ack", "--json")
    assert [json.loads(x)["body"] for x in out.splitlines()] == ["a", "b"]
    out = ok(capsys, ns, "consume", "few", "-n", "5", "--json")
    delivered = [json.loads(x) for x in out.splitlines()]
    assert [m["body"] for m in delivered] == ["a", "b"]
    assert [m["delivery_count"] for m in delivered] == [2, 2], delivered


def test_errors_are_one_line_with_a_nonzero_exit(ns, capsys):
    code, out, err = run(capsys, ns, "send", "nowhere", "x")
    assert code == 1 and "nowhere" in one_error_line(err)
    code, _, err = run(capsys, ns, "create-queue", "../escape")
    assert code == 1 and "escape" in one_error_line(err)
    code, _, err = run(capsys, ns, "consume", "nowhere", "--selector", "color = ")
    assert code == 1 and one_error_line(err)
    code, _, err = run(capsys, ns, "create-queue", "tiny", "--page-size-bytes", "100")
    assert code == 1 and "page_size_bytes" in one_error_line(err)  # names the setting
    ok(capsys, ns, "create-queue", "sel")
    code, _, err = run(capsys, ns, "consume", "sel", "--selector", "color = ")
    assert code == 1 and "'sel'" in one_error_line(err)  # the queue, and the position
    code, _, err = run(capsys, ns, "send", "q")
    assert code == 2 and "nothing to send" in one_error_line(err)
    code, _, err = run(capsys, "raymq-no-broker-here", "status")
    assert code == 1 and "raymq start" in one_error_line(err)


@pytest.mark.parametrize(
    "error",
    [
        raymq.errors.QueueNotFound("queue 'q' not found"),
        TypeError("body for queue 'q' must be bytes"),
        ValueError("bad value\nsecond line"),
        ConnectionError("cannot reach Ray at 'auto'"),
        KeyError("q"),
        RuntimeError("a bug"),
    ],
)
def test_every_error_is_one_line_with_status_1(monkeypatch, capsys, error):
    def fail(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(cli.common, "connect", fail)
    code, out, err = run(capsys, "any", "status")
    line = one_error_line(err)
    assert code == 1 and out == ""
    assert str(error).splitlines()[0].strip("'") in line


def test_ray_errors_are_one_line(monkeypatch, capsys):
    from ray.exceptions import RayActorError

    def fail(*_args, **_kwargs):
        raise RayActorError(error_msg="The actor died.\n\nTraceback (most recent call last):\n...")

    monkeypatch.setattr(cli.common, "connect", fail)
    code, _, err = run(capsys, "any", "status")
    assert code == 1 and "actor died" in one_error_line(err)


@pytest.mark.parametrize(
    "args",
    [
        ["consume", "q", "-n", "-3"],
        ["consume", "q", "-n", "0"],
        ["consume", "q", "--timeout", "-1"],
        ["send", "q", "--count", "-1"],
        ["send", "q", "--count", "0"],
        ["send", "q", "x", "--batch-size", "0"],
        ["send", "q", "x", "--timeout", "-2"],
        ["create-queue", "q", "--max-delivery-attempts", "0"],
        ["create-queue", "q", "--page-max-cache-size", "-1"],
        ["create-address", "a", "--address-full-policy", "NONE"],
        ["create-address", "a", "--max-delivery-attempts", "3"],  # a subscription's
        ["subscribe", "a"],
        ["subscribe", "a", "s", "--start", "middle"],
        ["seek", "a", "s", "middle"],
        ["send", "q", "x", "--priority", "256"],
        ["subscribe", "a", "s", "--max-delivery-attempts", "0"],
        ["unsubscribe", "a"],
        ["unsubscribe", "a/s"],  # two arguments, as subscribe takes
        ["delete-address"],
        ["delete-address", "a", "--force"],
        ["start", "--housekeeping-period", "0"],
        ["bench", "no-such-bench"],
        ["no-such-command"],
    ],
)
def test_usage_errors_exit_2_before_touching_ray(monkeypatch, capsys, args):
    def never(*_args, **_kwargs):
        raise AssertionError("a usage error must not connect")

    monkeypatch.setattr(cli.common, "connect", never)
    code, out, err = run(capsys, "any", *args)
    assert code == 2 and out == ""
    assert "--help" in one_error_line(err)


def test_help_explains_each_command_and_the_exit_status(capsys):
    commands = (
        "start", "stop", "status", "create-queue", "create-address", "subscribe",
        "unsubscribe", "delete-address", "send", "consume", "bench",
    )  # fmt: skip
    for command in commands:
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"Usage: raymq {command}") and "--help" in out
    assert main(["subscribe", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: raymq subscribe [OPTIONS] ADDRESS SUBSCRIPTION" in out
    assert all(o in out for o in ("--selector", "--start", "--dead-letter-queue"))
    assert main(["unsubscribe", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: raymq unsubscribe [OPTIONS] ADDRESS SUBSCRIPTION" in out and "--yes" in out
    assert main(["delete-address", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: raymq delete-address [OPTIONS] ADDRESS" in out and "-y, --yes" in out
    assert main(["consume", "--help"]) == 0
    assert "ADDRESS/SUBSCRIPTION" in capsys.readouterr().out
    assert main(["send", "--help"]) == 0
    assert "--batch-size" in capsys.readouterr().out
    assert main(["create-queue", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--max-delivery-attempts" in out and "--dead-letter-queue" in out
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert all(c in out for c in ("create-queue", "consume", "bench", "status", "subscribe"))
    assert "create-address" in out and "delete-address" in out and "unsubscribe" in out
    assert "1 on an error" in out and "2 on a usage error" in out
    assert "Exit status: 0 on success; 1 on an error" in " ".join(cli.__doc__.split())


@pytest.mark.parametrize(
    ("text", "value"),
    [("1048576", 2**20), ("64MiB", 64 * 2**20), ("10MB", 10**7), ("1.5KiB", 1536), ("3b", 3)],
)
def test_sizes(text, value):
    assert BYTES.convert(text, None, None) == value


# -- send --batch-size ------------------------------------------------------------------


def _consume_in_thread(namespace: str, queue: str, expect: int) -> tuple[threading.Thread, list]:
    """A consumer acking ``expect`` messages of ``queue`` in a thread; the list gets how
    many it acked (or the exception it met)."""
    result: list = []

    def consume() -> None:
        try:
            q = raymq.connect(namespace=namespace, create=False).get_queue(queue)
            got, deadline = 0, time.monotonic() + PROMPT
            with q.consumer(prefetch=8) as c:
                while got < expect and time.monotonic() < deadline:
                    messages = c.receive(expect - got, timeout=1)
                    c.ack(messages)
                    got += len(messages)
            result.append(got)
        except Exception as exc:  # reported to the test
            result.append(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    return thread, result


def test_batch_size_lets_a_small_block_queue_wait_for_room(ns, capsys):
    """A 16 KiB BLOCK queue refuses a batch of 60 x 1 KiB at once (it could never fit),
    and the error says to use --batch-size; batches of 4 wait for a consumer's acks."""
    args = ("--max-size-bytes", "16KiB", "--address-full-policy", "BLOCK")
    ok(capsys, ns, "create-queue", "small", *args)
    code, _, err = run(capsys, ns, "send", "small", "--count", "60", "--size", "1KiB")
    line = one_error_line(err)
    assert code == 1 and "'small'" in line and "--batch-size" in line
    assert status_json(capsys, ns)["queues"]["small"]["depth"] == 0

    thread, acked = _consume_in_thread(ns, "small", 60)
    code, out, err = run(
        capsys, ns, "send", "small", "--count", "60", "--size", "1KiB", "--batch-size", "4"
    )
    thread.join(PROMPT + 30)
    assert code == 0, err
    assert "sent 60 message(s)" in out and acked == [60]


def test_batch_size_splits_bodies_and_stdin(ns, capsys, monkeypatch):
    import io

    ok(capsys, ns, "create-queue", "lines")
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"line {i}\n" for i in range(7))))
    code, out, err = run(capsys, ns, "send", "lines", "a", "b", "--stdin", "--batch-size", "3")
    assert code == 0 and "sent 9 message(s)" in out, err
    out = ok(capsys, ns, "consume", "lines", "-n", "20", "--json")
    bodies = [json.loads(x)["body"] for x in out.splitlines()]
    assert bodies == ["a", "b", *(f"line {i}" for i in range(7))]


def test_batches():
    assert list(cli.batches(iter([b"1", b"2", b"3", b"4", b"5"]), 2)) == [
        [b"1", b"2"],
        [b"3", b"4"],
        [b"5"],
    ]
    assert list(cli.batches([], 3)) == []


# -- consume: stopping, selectors -------------------------------------------------------


def test_consume_stops_at_once_when_nothing_is_left(ns, capsys):
    """An empty queue, and a selector nothing matches behind 300 messages (a late
    consumer scans them first): both end well before their --timeout."""
    ok(capsys, ns, "create-queue", "idle")
    started = time.monotonic()
    out = ok(capsys, ns, "consume", "idle", "--timeout", str(2 * PROMPT))
    assert "0 message(s)" in out
    assert time.monotonic() - started < PROMPT

    ok(capsys, ns, "send", "idle", "--count", "300", "--size", "100", "-p", "color=blue")
    started = time.monotonic()
    code, out, err = run(
        capsys, ns, "consume", "idle", "--selector", "color = 'red'", "--timeout", str(2 * PROMPT)
    )
    assert code == 0 and "0 message(s)" in out and err == "", err
    assert time.monotonic() - started < PROMPT
    # ...and with what it wants present, it takes it all and stops.
    ok(capsys, ns, "send", "idle", "r1", "r2", "-p", "color=red")
    started = time.monotonic()
    out = ok(
        capsys, ns, "consume", "idle", "--selector", "color = 'red'", "-n", "50", "--json",
        "--timeout", str(2 * PROMPT),
    )  # fmt: skip
    assert [json.loads(x)["body"] for x in out.splitlines()] == ["r1", "r2"]
    assert time.monotonic() - started < PROMPT


class FakeConsumer:
    """Plays back receives; records each receive's timeout and each backlog call."""

    def __init__(self, receives: list[list], backlogs: list[int]):
        self.receives, self.backlogs = list(receives), list(backlogs)
        self.waits: list[float] = []
        self.backlog_calls = 0

    def receive(self, max_messages: int, timeout: float) -> list:
        self.waits.append(timeout)
        return self.receives.pop(0) if self.receives else []

    def backlog(self) -> int:
        self.backlog_calls += 1
        return self.backlogs.pop(0) if self.backlogs else 0


def test_drain_stops_on_an_empty_receive_with_no_backlog():
    c = FakeConsumer([[1, 2], [], []], backlogs=[0])
    seen: list = []
    assert cli.drain(c, 10, 100.0, seen.extend) == 2
    assert seen == [1, 2] and len(c.waits) == 2 and c.backlog_calls == 1
    assert all(w <= cli.CONSUME_POLL_SECONDS for w in c.waits)


def test_drain_keeps_receiving_while_the_backlog_is_not_empty():
    """A late selector consumer still scanning: empty receives, backlog > 0, then a match."""
    c = FakeConsumer([[], [], [7], []], backlogs=[5, 5, 0])
    seen: list = []
    assert cli.drain(c, 10, 100.0, seen.extend) == 1
    assert seen == [7] and len(c.waits) == 4


def test_drain_stops_at_max_messages_and_after_timeout():
    c = FakeConsumer([[1, 2, 3]], backlogs=[])
    assert cli.drain(c, 3, 100.0, lambda m: None) == 3 and c.backlog_calls == 0
    c = FakeConsumer([], backlogs=[1] * 1000)  # a backlog that never comes: --timeout ends it
    assert cli.drain(c, 3, 0.0, lambda m: None) == 0 and len(c.waits) == 1


def test_an_unquoted_selector_value_warns(ns, capsys):
    ok(capsys, ns, "create-queue", "paint")
    ok(capsys, ns, "send", "paint", "a", "b", "-p", "colour=red")
    code, out, err = run(capsys, ns, "consume", "paint", "--selector", "colour = red")
    assert code == 0 and "0 message(s)" in out, err
    assert err.startswith("raymq: warning: ") and len(err.strip().splitlines()) == 1
    assert "'red'" in err and "'paint'" in err and "\"colour = 'red'\"" in err
    assert "'colour'" not in err  # it is carried: only red is named
    code, out, err = run(capsys, ns, "consume", "paint", "--selector", "colour = 'red'")
    assert code == 0 and "2 message(s)" in out and err == "", err
    # An empty queue says nothing about property names: no warning.
    code, _, err = run(capsys, ns, "consume", "paint", "--selector", "shade = dark")
    assert code == 0 and err == "", err


class FakeQueue:
    """A queue whose browse yields ``n`` messages with the given properties."""

    name = "deep"

    def __init__(self, n: int | None, properties: dict):
        self.n, self.props, self.browsed = n, properties, 0

    def browse(self, selector=None, batch_size=1000):
        assert batch_size == cli.SELECTOR_CHECK_BATCH
        while self.n is None or self.browsed < self.n:
            self.browsed += 1
            yield type("M", (), {"properties": self.props})()


def test_selector_check_is_bounded_and_stops_early():
    q = FakeQueue(None, {"colour": "red"})  # endless: the bound ends it
    unseen, looked, whole = cli.unseen_properties(q, "colour = red")
    assert unseen == {"red"} and looked == cli.SELECTOR_CHECK_MESSAGES and not whole
    q = FakeQueue(None, {"colour": "red", "red": 1})
    assert cli.unseen_properties(q, "colour = red") == (set(), 1, False)  # seen at once
    q = FakeQueue(3, {})
    assert cli.unseen_properties(q, "JMSXDeliveryCount > 1") == (set(), 0, True)  # headers
    assert cli.unseen_properties(q, "a = b") == ({"a", "b"}, 3, True)


def test_selector_warning_text():
    text = cli.selector_warning("orders", "colour = red AND red <> x", {"red"}, 10_000, False)
    assert "property 'red'" in text and "first 10,000 messages of queue 'orders'" in text
    assert "\"colour = 'red' AND 'red' <> x\"" in text
    assert cli.quoted_suggestion("a=b OR b_2 = 'b'", {"b"}) == "a='b' OR b_2 = 'b'"


# -- start: settings of a running broker ------------------------------------------------


def test_start_twice_and_with_other_settings(ns, capsys):
    paging_dir = paging_directory_of(ns)
    out = ok(capsys, ns, "start", "--paging-directory", paging_dir, "--housekeeping-period", "0.5")
    assert "already running" in out
    out = ok(capsys, ns, "start")
    assert "already running" in out
    code, _, err = run(capsys, ns, "start", "--max-message-size", "5MiB")
    line = one_error_line(err)
    assert code == 1 and "max_message_size: 100.0 MiB" in line and "-> 5.0 MiB" in line
    assert "raymq stop" in line and repr(ns) in line
    assert "paging_directory" not in line and "BrokerConfig" not in line
    code, _, err = run(
        capsys, ns, "start", "--paging-directory", paging_dir, "--housekeeping-period", "2"
    )
    line = one_error_line(err)
    assert code == 1 and "housekeeping_period: 0.5 s -> 2 s" in line
    assert "paging_directory" not in line


def test_start_makes_the_paging_directory_absolute(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    name = f"raymq-cli-{uuid.uuid4().hex[:8]}"
    try:
        code, out, err = run(capsys, name, "start", "--paging-directory", "rel")
        assert code == 0, err
        assert f"paging directory {tmp_path / 'rel'};" in out
    finally:
        main(["--namespace", name, "stop"])


def test_setting_differences():
    from raymq.config import BrokerConfig

    running = BrokerConfig(paging_directory="/data", flow_to_disk_threshold=None)
    asked = {"paging_directory": "/data", "flow_to_disk_threshold": 2**30, "max_message_size": 5}
    assert cli.setting_differences(running, asked) == [
        "flow_to_disk_threshold: default -> 1.0 GiB (1,073,741,824 bytes)",
        "max_message_size: 100.0 MiB (104,857,600 bytes) -> 5 B (5 bytes)",
    ]
    assert cli.setting_differences(running, {"paging_directory": "/data"}) == []


# -- status: metrics, memory columns, dead-letter queues --------------------------------


def test_status_shows_where_the_metrics_are(ns, capsys):
    import ray

    expected = {
        f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        for n in ray.nodes()
        if n["Alive"]
    }
    assert set(status_json(capsys, ns)["metrics"]) == expected
    out = ok(capsys, ns, "status")
    assert all(url in out for url in expected)


def test_metrics_urls():
    nodes = [
        {"NodeManagerAddress": "10.0.0.2", "MetricsExportPort": 8080, "Alive": True},
        {"NodeManagerAddress": "10.0.0.3", "MetricsExportPort": 8080, "Alive": False},
        {"NodeManagerAddress": "fd00::2", "MetricsExportPort": 9, "Alive": True},
        {"NodeManagerAddress": "10.0.0.4", "MetricsExportPort": 0, "Alive": True},
    ]
    assert cli.metrics_urls(nodes) == ["http://10.0.0.2:8080/metrics", "http://[fd00::2]:9/metrics"]


def test_status_shows_caches_apart(ns, capsys):
    ok(capsys, ns, "create-queue", "orders")
    ok(capsys, ns, "send", "orders", "--count", "10")
    out = ok(capsys, ns, "status")
    header = next(line for line in out.splitlines() if "depth" in line)
    assert "head cache" in header and "read cache" in header
    assert "memory" not in header  # no sum of caches that can overlap
    assert "not added up" in " ".join(out.split())


def test_dead_letter_queues_beside_their_queues(ns, capsys):
    args = ("--max-delivery-attempts", "1", "--dead-letter-queue", "poison")
    ok(capsys, ns, "create-queue", "orders", *args)
    ok(capsys, ns, "create-queue", "audit")
    ok(capsys, ns, "send", "orders", "bad1", "bad2", "good")
    out = ok(capsys, ns, "consume", "orders", "-n", "2", "--no-ack")
    assert "2 message(s)" in out  # delivered once, given back: dead letters
    deadline = time.monotonic() + PROMPT
    while (s := status_json(capsys, ns)["queues"])["orders"]["messages_dead_lettered"] < 2:
        assert time.monotonic() < deadline, s["orders"]
        time.sleep(0.1)  # polling the condition; the move runs in the queue actor
    assert s["orders"]["dead_letter_queue"] == "poison" and s["poison"]["depth"] == 2
    out = ok(capsys, ns, "status")
    rows = [line for line in out.splitlines() if line.startswith("│")]
    names = [re.split(r"\s*│\s*", row)[1] for row in rows[:3]]
    assert names == ["audit", "orders", "poison (DLQ of orders)"]
    assert re.search(r"│\s+2\s+│\s+│$", rows[1])  # orders: 2 dead-lettered, none expired


def test_sends_with_a_ttl_expire_to_the_expiry_queue_and_status_says_so(ns, capsys):
    scan = ("--message-expiry-scan-period-s", "0.2")
    ok(capsys, ns, "create-queue", "short", "--expiry-queue", "short.gone", *scan)
    ok(capsys, ns, "send", "short", "a", "b", "--ttl", "0.2")
    ok(capsys, ns, "send", "short", "kept")
    deadline = time.monotonic() + PROMPT
    while (s := status_json(capsys, ns)["queues"])["short"]["messages_expired"] < 2:
        assert time.monotonic() < deadline, s["short"]
        time.sleep(0.1)  # polling the condition; the expiry pass runs in the queue actor
    assert s["short"]["depth"] == 1 and s["short.gone"]["depth"] == 2
    assert "2 (short.gone)" in ok(capsys, ns, "status")
    out = ok(capsys, ns, "consume", "short", "-n", "1", "--json")
    assert [json.loads(x)["body"] for x in out.splitlines()] == ["kept"]


def test_send_with_a_delay_is_consumed_once_its_time_came(ns, capsys):
    ok(capsys, ns, "create-queue", "later")
    ok(capsys, ns, "send", "later", "far", "--delay", "3600")
    out = ok(capsys, ns, "consume", "later", "-n", "1", "--json", "--timeout", "0.1")
    assert out == ""  # not before its time
    assert status_json(capsys, ns)["queues"]["later"]["scheduled"] == 1
    ok(capsys, ns, "send", "later", "soon", "--delay", "0.3")
    out = ok(capsys, ns, "consume", "later", "-n", "1", "--json", "--timeout", str(PROMPT))
    assert [json.loads(x)["body"] for x in out.splitlines()] == ["soon"]
    both = ("--delay", "1", "--deliver-at", "2030-01-01")
    code, _out, err = run(capsys, ns, "send", "later", "x", *both)
    assert code != 0 and "not both" in err


def test_send_with_a_priority_is_consumed_first_on_a_queue_with_max_priority(ns, capsys):
    ok(capsys, ns, "create-queue", "ranked", "--max-priority", "5")
    ok(capsys, ns, "send", "ranked", "low-1", "low-2")
    ok(capsys, ns, "send", "ranked", "urgent", "--priority", "5")
    s = status_json(capsys, ns)["queues"]["ranked"]
    assert (s["max_priority"], s["prioritized"]) == (5, 1)
    out = ok(capsys, ns, "consume", "ranked", "-n", "3", "--json", "--timeout", str(PROMPT))
    assert [json.loads(x)["body"] for x in out.splitlines()] == ["urgent", "low-1", "low-2"]
    code, _out, err = run(capsys, ns, "send", "ranked", "x", "--priority", "256")
    assert code != 0 and "256" in err


def test_an_address_with_retention_replays_after_a_seek_and_from_an_offset(ns, capsys):
    ok(capsys, ns, "create-address", "log", "--retention-s", "3600")
    ok(capsys, ns, "subscribe", "log", "reader")
    ok(capsys, ns, "send", "log", "a", "b", "c")
    read = ("consume", "log/reader", "-n", "3", "--json", "--timeout", str(PROMPT))
    assert [json.loads(x)["body"] for x in ok(capsys, ns, *read).splitlines()] == ["a", "b", "c"]
    assert "from offset 1" in ok(capsys, ns, "seek", "log", "reader", "1")
    read = ("consume", "log/reader", "-n", "2", "--json", "--timeout", str(PROMPT))
    assert [json.loads(x)["body"] for x in ok(capsys, ns, *read).splitlines()] == ["b", "c"]
    ok(capsys, ns, "subscribe", "log", "late", "--start", "2")
    read = ("consume", "log/late", "-n", "1", "--json", "--timeout", str(PROMPT))
    assert [json.loads(x)["body"] for x in ok(capsys, ns, *read).splitlines()] == ["c"]
    assert status_json(capsys, ns)["addresses"]["log"]["retained"] == 3
    code, _out, err = run(capsys, ns, "seek", "log", "reader", "soon")
    assert code != 0 and "'soon'" in err


def test_dead_letter_queue_order():
    stats = {
        "b": {"dead_letter_queue": "b.DLQ"},
        "b.DLQ": {"dead_letter_queue": "b.DLQ.DLQ"},
        "a": {"dead_letter_queue": "shared"},
        "c": {"dead_letter_queue": "shared"},
        "shared": {},
        "old": {},  # stats without dead-letter keys (before dead-letter queues existed)
    }
    assert cli.dead_letter_sources(stats) == {"b.DLQ": ["b"], "shared": ["a", "c"]}
    assert cli.queue_order(stats) == ["a", "shared", "b", "b.DLQ", "c", "old"]


def test_create_queue_passes_dead_letter_settings_only_when_given(monkeypatch, capsys):
    made = []

    class Broker:
        def create_queue(self, name, **settings):
            made.append(settings)
            return type("Q", (), {"name": name})()

    monkeypatch.setattr(cli.common, "connect", lambda ctx, **kw: Broker())
    ok(capsys, "any", "create-queue", "a")
    ok(capsys, "any", "create-queue", "b", "--max-delivery-attempts", "3")
    assert "max_delivery_attempts" not in made[0] and "dead_letter_queue" not in made[0]
    assert "default_ttl_s" not in made[0] and "expiry_queue" not in made[0]
    assert "max_priority" not in made[0]
    assert made[1]["max_delivery_attempts"] == 3 and "dead_letter_queue" not in made[1]


def test_a_replicated_queue_needs_as_many_nodes_and_says_so(capsys, ns):
    code, _out, err = run(capsys, ns, "create-queue", "rq", "--replicas", "2")
    assert code != 0
    line = one_error_line(err)
    assert "'rq'" in line and "2 replicas need 2 alive nodes; 1 are" in line
    code, _out, err = run(
        capsys, ns, "create-queue", "rq", "--replicas", "3", "--min-insync-replicas", "1"
    )
    assert "min_insync_replicas=1" in one_error_line(err) and "between 2 and 3" in err
    assert "rq" not in json.loads(ok(capsys, ns, "status", "--json"))["queues"]


# -- addresses and subscriptions --------------------------------------------------------


def _row(out: str, label: str) -> list[str]:
    """The cells of the status table row whose first cell is ``label``."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0] == label:
            return cells
    raise AssertionError(f"no row {label!r} in:\n{out}")


def test_addresses_subscriptions_send_consume_status(ns, capsys):
    args = ("--max-size-bytes", "1MiB", "--address-full-policy", "FAIL")
    out = ok(capsys, ns, "create-address", "events", *args)
    assert "address 'events' ready" in out
    # No subscription yet: the message reaches nobody, and the command says so.
    code, out, err = run(capsys, ns, "send", "events", "lost")
    assert code == 0 and "sent 1 message(s) to address 'events'" in out
    assert err.startswith("raymq: warning: ") and len(err.strip().splitlines()) == 1
    assert "no subscription" in err and "raymq subscribe events" in err

    out = ok(capsys, ns, "subscribe", "events", "audit")
    assert "subscription 'events/audit' ready" in out
    ok(capsys, ns, "subscribe", "events", "audit")  # again, same settings: fine
    code, out, err = run(capsys, ns, "send", "events", "a", "-p", "color=blue")
    assert code == 0 and err == "" and "sent 1 message(s) to address 'events'" in out
    ok(capsys, ns, "subscribe", "events", "red", "--selector", "color = 'red'", "--start=earliest")
    ok(capsys, ns, "subscribe", "events", "all", "--start", "earliest")
    ok(capsys, ns, "subscribe", "events", "late")
    ok(capsys, ns, "create-queue", "poison")
    args = ("--max-delivery-attempts", "1", "--dead-letter-queue", "poison")
    ok(capsys, ns, "subscribe", "events", "dl", *args)
    ok(capsys, ns, "send", "events", "b", "c", "-p", "color=red")

    status = status_json(capsys, ns)
    assert "events" not in status["queues"] and set(status["queues"]) == {"poison"}
    events = status["addresses"]["events"]
    assert events["max_size_bytes"] == 2**20 and events["address_full_policy"] == "FAIL"
    subs = events["subscriptions"]
    assert list(subs) == ["audit", "red", "all", "late", "dl"]  # as created
    lags = {name: s["depth"] for name, s in subs.items()}
    assert lags == {"audit": 3, "red": 2, "all": 3, "late": 2, "dl": 2}
    assert subs["dl"]["dead_letter_queue"] == "poison"
    out = ok(capsys, ns, "status")
    assert f"addresses in namespace {ns}" in out and "its lag" in " ".join(out.split())
    assert _row(out, "events")[1:2] == ["3"] and "FAIL at 1.0 MiB" in _row(out, "events")
    assert _row(out, "events/audit")[1:3] == ["3", "0"]  # depth (lag), in flight
    assert _row(out, "events/red")[1] == "2" and _row(out, "events/late")[1] == "2"
    assert _row(out, "events/red")[6] == ""  # disk: the address's, not repeated
    assert _row(out, "poison (DLQ of events/dl)")[1] == "0"
    out = ok(capsys, ns, "start")
    assert "already running" in out and "1 queue(s), 1 address(es)" in out

    out = ok(capsys, ns, "consume", "events/red", "--json")
    assert [json.loads(x)["body"] for x in out.splitlines()] == ["b", "c"]
    out = ok(capsys, ns, "consume", "events/all", "--selector", "color = 'blue'", "--json")
    assert [json.loads(x)["body"] for x in out.splitlines()] == ["a"]
    out = ok(capsys, ns, "consume", "events/audit", "-n", "2")
    assert "2 message(s) from 'events/audit'" in out
    subs = status_json(capsys, ns)["addresses"]["events"]["subscriptions"]
    lags = {name: s["depth"] for name, s in subs.items()}
    assert lags == {"audit": 1, "red": 0, "all": 2, "late": 2, "dl": 2}


def test_address_and_subscription_errors_are_one_line(ns, capsys):
    ok(capsys, ns, "create-address", "events")
    ok(capsys, ns, "create-queue", "orders")
    ok(capsys, ns, "subscribe", "events", "audit")
    cases = [
        (("subscribe", "nowhere", "s"), ["address 'nowhere' does not exist"]),
        (("subscribe", "orders", "s"), ["'orders' is a queue, not an address"]),
        (("subscribe", "events", "a/b"), ["'a/b'"]),
        (("subscribe", "events", "bad", "--selector", "color = "),
         ["subscription 'events/bad'", "position"]),
        (("subscribe", "events", "audit", "--start", "earliest", "--selector", "a = 1"),
         ["'audit'", "other settings"]),
        (("consume", "events/nosub"), ["no subscription 'nosub'", "it has: audit"]),
        (("consume", "nowhere/audit"), ["address 'nowhere' does not exist"]),
        (("consume", "events"), ["'events' is an address", "events/SUBSCRIPTION", "audit"]),
        (("consume", "events/audit", "--selector", "color = "),
         ["subscription 'events/audit'", "position"]),
        (("send", "events/audit", "x"), ["is a subscription", "raymq send events "]),
        (("send", "nowhere", "x"), ["no queue or address 'nowhere'"]),
        (("create-address", "orders"), ["'orders' exists, as a queue"]),
        (("create-queue", "events"), ["'events' exists, as an address"]),
        (("unsubscribe", "nowhere", "s", "--yes"), ["address 'nowhere' does not exist"]),
        (("unsubscribe", "orders", "s", "--yes"), ["'orders' is a queue, not an address"]),
        (("unsubscribe", "events", "nosub", "--yes"),
         ["address 'events' has no subscription 'nosub'", "it has: audit"]),
        (("unsubscribe", "events", "audit"),  # stdin is no terminal: no one to ask
         ["not deleting subscription 'events/audit': 0 unacknowledged", "without --yes"]),
        (("delete-address", "nowhere", "--yes"), ["address 'nowhere' does not exist"]),
        (("delete-address", "orders", "--yes"), ["'orders' is a queue, not an address"]),
        (("delete-address", "../escape", "--yes"), ["'../escape'"]),
        (("delete-address", "events"),
         ["not deleting address 'events'", "1 subscription(s) (audit)", "without --yes"]),
    ]  # fmt: skip
    for args, parts in cases:
        code, out, err = run(capsys, ns, *args)
        line = one_error_line(err)
        assert code == 1 and out == "", (args, out)
        assert all(p in line for p in parts), (args, line)
    # The errors are typed (the class shows in --verbose's traceback).
    for args, error in (
        (("unsubscribe", "events", "nosub", "--yes"), "raymq.errors.SubscriptionNotFound"),
        (("delete-address", "nowhere", "--yes"), "raymq.errors.QueueNotFound"),
    ):
        code, _, err = run(capsys, ns, "--verbose", *args)
        assert code == 1 and error in err, err
    # Nothing was made, nor deleted, by the failures.
    status = status_json(capsys, ns)
    assert list(status["addresses"]["events"]["subscriptions"]) == ["audit"]
    assert set(status["queues"]) == {"orders"}


def test_unsubscribe_and_delete_address(ns, capsys):
    paging_dir = paging_directory_of(ns)
    ok(capsys, ns, "create-address", "events")
    ok(capsys, ns, "create-queue", "poison")
    ok(capsys, ns, "subscribe", "events", "audit")
    ok(capsys, ns, "subscribe", "events", "red", "--selector", "color = 'red'")
    dl = ("--max-delivery-attempts", "1", "--dead-letter-queue", "poison")
    ok(capsys, ns, "subscribe", "events", "dl", "--selector", "color = 'red'", *dl)
    ok(capsys, ns, "send", "events", "a", "-p", "color=blue")
    ok(capsys, ns, "send", "events", "b", "-p", "color=red")
    assert status_json(capsys, ns)["addresses"]["events"]["depth"] == 2

    out = ok(capsys, ns, "unsubscribe", "events", "audit", "--yes")
    assert out.strip() == "subscription 'events/audit' deleted, with 2 unacknowledged message(s)"
    events = status_json(capsys, ns)["addresses"]["events"]
    assert list(events["subscriptions"]) == ["red", "dl"]
    assert events["depth"] == 1  # 'a' was audit's alone: released with it
    out = ok(capsys, ns, "unsubscribe", "events", "dl", "-y")
    assert out.strip() == (
        "subscription 'events/dl' deleted, with 1 unacknowledged message(s);"
        " dead-letter queue(s) 'poison' kept (queues of their own)"
    )
    code, _, err = run(capsys, ns, "consume", "events/dl")
    assert code == 1 and "no subscription 'dl' (it has: red)" in one_error_line(err)
    ok(capsys, ns, "subscribe", "events", "dl", "--start", "earliest", *dl)  # again, anew
    assert status_json(capsys, ns)["addresses"]["events"]["subscriptions"]["dl"]["depth"] == 1

    assert os.path.isdir(os.path.join(paging_dir, "events"))
    out = ok(capsys, ns, "delete-address", "events", "--yes")
    assert out.strip() == (
        "address 'events' deleted, with 2 subscription(s) and 1 stored message(s);"
        " dead-letter queue(s) 'poison' kept (queues of their own)"
    )
    assert not os.path.exists(os.path.join(paging_dir, "events"))  # its files went too
    status = status_json(capsys, ns)
    assert status["addresses"] == {} and set(status["queues"]) == {"poison"}
    code, _, err = run(capsys, ns, "consume", "events/red")
    assert code == 1 and "address 'events' does not exist" in one_error_line(err)
    ok(capsys, ns, "create-queue", "events")  # the name is free again
    out = ok(capsys, ns, "start")
    assert "already running" in out and "; 2 queue(s)\n" in out  # and no address


def test_the_readme_address_commands_run_as_typed(ns, capsys):
    """README.md's ``address-commands`` block, each line run as the shell splits it."""
    outs = []
    for line in readme_block("address-commands"):
        raymq_, *args = shlex.split(line)
        assert raymq_ == "raymq", line
        outs.append(ok(capsys, ns, *args))
    consumed = [json.loads(x) for x in outs[4].splitlines()]
    assert [(m["body"], m["properties"]) for m in consumed] == [("hello", {"color": "red"})]
    assert "subscription 'events/red' deleted" in outs[5]
    assert "address 'events' deleted, with 1 subscription(s) and 1 stored message(s)" in outs[6]
    assert status_json(capsys, ns)["addresses"] == {}


def test_subscription_sources_label_their_dead_letter_queues():
    subs = {
        "audit": {"dead_letter_queue": "events.audit.DLQ"},
        "billing": {"dead_letter_queue": "shared"},
    }
    addresses = {"events": {"dead_letter_queue": "events.DLQ", "subscriptions": subs}}
    flat = cli.subscription_sources(addresses)
    assert set(flat) == {"events/audit", "events/billing"}
    queues = {"events.audit.DLQ": {}, "shared": {}, "orders": {"dead_letter_queue": "shared"}}
    assert cli.dead_letter_sources({**queues, **flat}) == {
        "events.audit.DLQ": ["events/audit"],
        "shared": ["orders", "events/billing"],
    }
    sub = {"depth": 1, "in_flight": 0, "head_cache_bytes": 0, "consumers": 0}
    assert len(cli.overview._subscription_cells(sub)) == len(cli.STATS_COLUMNS)


# -- bench ------------------------------------------------------------------------------


def test_bench_starts_its_own_ray_unless_told(monkeypatch, capsys):
    """With RAY_ADDRESS set (a cluster running), the bench's environment names no
    cluster, so bench.common starts a local Ray; --address (either place) joins one."""
    ran = []

    def fake_run(argv, cwd, env):
        ran.append((argv, env))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(cli.benches.subprocess, "run", fake_run)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setenv(cli.BENCH_ADDRESS_ENV, "stale:1")
    assert main(["bench", "throughput", "--", "--seconds", "1"]) == 0
    assert main(["bench", "shares", "--address", "h:1"]) == 0
    assert main(["--address", "h:2", "bench", "shares"]) == 0
    (argv, env), (_, env1), (_, env2) = ran
    assert argv[-4:] == ["-m", "bench.throughput", "--seconds", "1"]
    assert "RAY_ADDRESS" not in env and cli.BENCH_ADDRESS_ENV not in env
    assert env1[cli.BENCH_ADDRESS_ENV] == "h:1" and env2[cli.BENCH_ADDRESS_ENV] == "h:2"
    assert "RAY_ADDRESS" not in env1


def test_bench_common_starts_a_local_ray_unless_told(monkeypatch):
    import ray

    import bench.common

    assert bench.common.BENCH_ADDRESS_ENV == cli.BENCH_ADDRESS_ENV
    assert "throughput" in cli.available_benches() and "common" not in cli.available_benches()
    calls = []

    class Stop(Exception):
        pass

    def fake_init(**kwargs):
        calls.append(kwargs)
        raise Stop

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # ignored: "local" is a new Ray
    monkeypatch.delenv(cli.BENCH_ADDRESS_ENV, raising=False)
    with pytest.raises(Stop):
        bench.common.start_broker("x")
    monkeypatch.setenv(cli.BENCH_ADDRESS_ENV, "h:1")
    with pytest.raises(Stop):
        bench.common.start_broker("x")
    assert calls[0]["address"] == "local" and calls[1]["address"] == "h:1"


def test_a_command_starts_no_spare_target_list(monkeypatch):
    """A command makes one consumer at most and ends: it connects with warm=False, and
    its consumer is made where no next spare is started (each would be a Ray worker
    started for nothing). The process is itself again after (the suite runs commands
    in-process)."""
    from raymq.placement import spares

    from raymq.cli import common

    seen = {}
    monkeypatch.setattr(common, "join_ray", lambda *a, **k: None)
    monkeypatch.setattr(raymq, "connect", lambda **kw: seen.update(kw))
    ctx = type("Ctx", (), {"obj": {"address": None, "namespace": "n", "verbose": False}})()
    common.connect(ctx)
    assert seen["warm"] is False

    monkeypatch.setattr(spares, "_making", {})  # other tests' spares are not this one's
    monkeypatch.setattr(spares, "_spares", {})
    with spares.none_started():
        spares.warm("some-node")  # Ray-free: nothing is started, nothing is waited for
    assert not spares._making and not spares._spares
    assert spares._keeping


def test_the_consume_command_makes_its_consumer_where_no_spare_is_started(broker, monkeypatch):
    from raymq.placement import spares

    q = broker.create_queue("one-consumer")
    q.send(b"x")
    kept = []
    real = type(q).consumer

    def consumer(self, *args, **kwargs):
        kept.append(spares._keeping)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(q), "consumer", consumer)
    assert main(["--namespace", broker.namespace, "consume", "one-consumer", "-n", "1"]) == 0
    assert kept == [False] and spares._keeping
    assert q.stats()["depth"] == 0


def test_copies_left_behind_are_shown_and_removed_on_their_node(capsys, ray_session, paging_dir):
    """Replica copies a broker gave up (recorded in .leftovers.json, as its controller
    does): ``raymq status`` lists them, ``remove-leftovers --dry-run`` changes nothing,
    ``remove-leftovers`` removes each on its node, but not one whose lock a running
    queue process holds (exit 1, kept), which goes once that process is gone."""
    import subprocess
    import sys

    import ray

    from raymq.core.leftovers import LEFTOVERS_NAME, Leftovers

    node = ray.get_runtime_context().get_node_id()
    copies = {rid: os.path.join(paging_dir, "gone", rid) for rid in ("r0", "r3")}
    for path in copies.values():
        os.makedirs(path)
        with open(os.path.join(path, "00000000000000000000.seg"), "wb") as f:
            f.write(b"x" * 4096)
    recorded = Leftovers(paging_dir)
    recorded.add("gone", "r0", node, "replaced leader; its node was lost")
    recorded.add("gone", "r3", node, "lost follower; replaced")
    holder = subprocess.Popen(  # a queue process holding r3's directory
        [
            sys.executable,
            "-c",
            "import sys; from raymq.storage.lock import DirectoryLock;"
            f"DirectoryLock.acquire({copies['r3']!r}, 'gone'); print('held', flush=True);"
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    name = f"raymq-cli-{uuid.uuid4().hex[:8]}"
    assert main(["--namespace", name, "start", "--paging-directory", paging_dir]) == 0
    try:
        shown = ok(capsys, name, "status")
        assert "replica copies left behind" in shown and "its node was lost" in shown
        assert "would be removed" in ok(capsys, name, "remove-leftovers", "--dry-run")
        assert all(os.path.isdir(p) for p in copies.values())
        code, out, _err = run(capsys, name, "remove-leftovers")
        assert code == 1, out
        assert "gone/r0" in out and "removed" in out and "gone/r3" in out and "failed" in out
        assert not os.path.exists(copies["r0"]) and os.path.isdir(copies["r3"])
        holder.stdin.close()
        holder.wait(timeout=60)
        assert "removed" in ok(capsys, name, "remove-leftovers")
        assert not os.path.exists(os.path.join(paging_dir, "gone"))  # nothing else in it
        assert "replica copies left behind" not in ok(capsys, name, "status")
        with open(os.path.join(paging_dir, LEFTOVERS_NAME)) as f:
            assert json.load(f) == []
    finally:
        holder.kill()
        main(["--namespace", name, "stop"])
