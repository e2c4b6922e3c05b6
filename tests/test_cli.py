"""The ``raymq`` command, run in-process against the session's real Ray."""

from __future__ import annotations

import json
import uuid

import pytest

from raymq.cli import BYTES, main


@pytest.fixture
def ns(ray_session, paging_dir):
    """A namespace with a broker started by ``raymq start``; stopped afterwards."""
    name = f"raymq-cli-{uuid.uuid4().hex[:8]}"
    assert (
        main(
            [
                "--namespace",
                name,
                "start",
                "--paging-directory",
                paging_dir,
                "--housekeeping-period",
                "0.5",
            ]
        )
        == 0
    )
    yield name
    main(["--namespace", name, "stop"])


def run(capsys, ns: str, *args: str) -> tuple[int, str, str]:
    code = main(["--namespace", ns, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


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
    code, out, _ = run(capsys, ns, "send", "orders", "one", "two", "-p", "color=red", "-p", "n=3")
    assert code == 0 and "sent 2 message(s)" in out
    assert run(capsys, ns, "send", "orders", "--count", "100", "--size", "1KiB")[0] == 0

    code, out, _ = run(capsys, ns, "status", "--json")
    status = json.loads(out)
    q = status["queues"]["orders"]
    assert code == 0 and q["depth"] == 102 and q["address_full_policy"] == "FAIL"
    assert q["max_size_bytes"] == 2**20 and "plan" in status["governor"]
    code, out, _ = run(capsys, ns, "status")
    assert code == 0 and "orders" in out and "FAIL" in out and "MemoryGovernor" in out

    code, out, _ = run(capsys, ns, "consume", "orders", "--selector", "color = 'red'", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [m["body"] for m in lines] == ["one", "two"]
    assert lines[0]["properties"] == {"color": "red", "n": 3} and lines[0]["offset"] == 0
    code, out, _ = run(capsys, ns, "consume", "orders", "-n", "5", "--no-ack", "--timeout", "2")
    assert code == 0 and len([x for x in out.splitlines() if "\t" in x]) == 5
    code, out, _ = run(capsys, ns, "status", "--json")
    assert json.loads(out)["queues"]["orders"]["depth"] == 100  # only the red two acked


def test_errors_are_one_line_with_a_nonzero_exit(ns, capsys):
    code, out, err = run(capsys, ns, "send", "nowhere", "x")
    assert code == 1 and err.startswith("raymq: error:") and "nowhere" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, _, err = run(capsys, ns, "create-queue", "../escape")
    assert code == 1 and "escape" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, ns, "consume", "nowhere", "--selector", "color = ")
    assert code == 1 and err.startswith("raymq: error:")
    code, _, err = run(capsys, ns, "send", "q")
    assert code == 2 and "nothing to send" in err
    code, _, err = run(capsys, "raymq-no-broker-here", "status")
    assert code == 1 and "raymq start" in err


def test_help_explains_each_command(capsys):
    for command in ("start", "stop", "status", "create-queue", "send", "consume", "bench"):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"Usage: raymq {command}") and "--help" in out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("create-queue", "consume", "bench", "status"))


@pytest.mark.parametrize(
    ("text", "value"),
    [("1048576", 2**20), ("64MiB", 64 * 2**20), ("10MB", 10**7), ("1.5KiB", 1536), ("3b", 3)],
)
def test_sizes(text, value):
    assert BYTES.convert(text, None, None) == value
