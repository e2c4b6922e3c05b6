"""The installed ``raymq`` script in a subprocess: what reaches its stdout and stderr
(only the command's own output, never Ray's log lines) and how fast an address nobody
answers fails. The suite's Ray runs in the pytest process (``tests/conftest.py``)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from raymq import _cli_ray
from raymq.cli import main
from raymq.errors import BrokerUnavailable

RAYMQ = shutil.which("raymq", path=str(Path(sys.executable).parent)) or "raymq"
#: What Ray's log lines look like: Python's ("2026-11-23 17:55:44,602<TAB>WARNING
#: services.py:442 -- ...") and C++'s ("[2026-11-23 17:43:05,668 W 31338 31338]
#: rpc_client.h:153: ..."), and the texts of the token banner and connection messages.
RAY_LOG_LINE = re.compile(
    r"^\[?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    r"|\b(?:INFO|WARNING) \w+\.py:\d+"
    r"|gcs_client|rpc_client|core_worker|Token authentication|Connecting to existing Ray",
    re.MULTILINE,
)
#: Seconds an unreachable address may take beyond the script's start-up (`--help`);
#: Ray alone took 80 s and more. Generous: start-up times vary on a loaded machine.
FAIL_FAST_SECONDS = 10.0


def ray_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if RAY_LOG_LINE.search(line)]


def free_port() -> int:
    """A TCP port nobody listens on (on every interface: Ray turns 127.0.0.1 into the
    node's address)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def raymq(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    """Run the installed script; returns (exit status, stdout, stderr, seconds)."""
    started = time.monotonic()
    done = subprocess.run(
        [RAYMQ, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


def base_env() -> dict[str, str]:
    """This process's environment without a cluster address."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture
def ns(ray_session, paging_dir):
    """A namespace with a broker and a queue ``q`` holding one message."""
    name = f"raymq-proc-{uuid.uuid4().hex[:8]}"
    assert main(["--namespace", name, "start", "--paging-directory", paging_dir]) == 0
    assert main(["--namespace", name, "create-queue", "q"]) == 0
    assert main(["--namespace", name, "send", "q", "hello", "-p", "colour=red"]) == 0
    yield name
    main(["--namespace", name, "stop"])


@pytest.fixture
def gcs_address(ray_session) -> str:
    return ray_session.get_runtime_context().gcs_address


def auto_env(tmp_path: Path, gcs_address: str) -> dict[str, str]:
    """An environment in which ``--address auto`` finds the suite's Ray deterministically:
    Ray reads ``$RAY_TMPDIR/ray/ray_current_cluster`` (other Rays on this machine are only
    a fallback). Without ``RAY_AUTH_MODE`` (when the suite's Ray uses tokens) Ray turns
    token mode on by itself and logs its banner: the path users take on a head node."""
    (tmp_path / "ray").mkdir(exist_ok=True)
    (tmp_path / "ray" / "ray_current_cluster").write_text(gcs_address)
    env = base_env()
    env["RAY_TMPDIR"] = str(tmp_path)
    if env.get("RAY_AUTH_MODE") == "token":
        del env["RAY_AUTH_MODE"]
    return env


def test_commands_print_no_ray_log_lines(ns, tmp_path, gcs_address):
    env = auto_env(tmp_path, gcs_address)
    for args in (
        ["create-address", "ev"],
        ["subscribe", "ev", "s", "--selector", "colour = 'blue'"],
        ["send", "ev", "x", "-p", "colour=blue"],
        ["consume", "ev/s", "--json"],
        ["status"],  # with an address and its subscription
        ["status", "--json"],
        ["send", "q", "x", "-p", "colour=blue"],
        ["consume", "q", "-n", "1", "--json"],
        ["consume", "q", "--selector", "colour = red"],  # a warning, and nothing from Ray
        ["--address", gcs_address, "status"],  # an explicit address: RAY_AUTH_MODE as set
    ):
        explicit = args[0] == "--address"
        code, out, err, _ = raymq("--namespace", ns, *args, env=base_env() if explicit else env)
        assert code == 0, err
        assert ray_lines(out) == [] and ray_lines(err) == [], (args, out, err)
        assert err == "" or err.startswith("raymq: warning: selector"), err
    code, out, err, _ = raymq("--namespace", "raymq-proc-none", "status", env=env)
    assert code == 1 and out == "" and err.startswith("raymq: error: no RayMQ broker")
    assert len(err.splitlines()) == 1


def on_a_terminal(*args: str, answer: str, env: dict[str, str]):
    """Run the installed script with a terminal (a pty) as its stdin, on which ``answer``
    is typed ahead; returns (exit status, stdout, stderr)."""
    master, slave = os.openpty()
    try:
        os.write(master, answer.encode() + b"\n")
        done = subprocess.run(
            [RAYMQ, *args], env=env, capture_output=True, text=True, timeout=120, stdin=slave
        )
    finally:
        os.close(slave)
        os.close(master)
    return done.returncode, done.stdout, done.stderr


def test_everything_the_script_prints_reaches_a_pipe_and_its_status_is_kept(
    ns, tmp_path, gcs_address
):
    """The script ends at once after the command (``raymq.cli.run``: ``os._exit``, no
    interpreter finalization): what it printed is flushed first, to the last line of a
    large output, and the exit status is the command's."""
    n = 4000  # ~0.5 MiB of JSON lines: far beyond Python's and the pipe's buffers
    assert main(["--namespace", ns, "send", "q", "--count", str(n - 1), "--size", "64"]) == 0
    env = auto_env(tmp_path, gcs_address)
    code, out, err, _ = raymq("--namespace", ns, "consume", "q", "-n", str(n), "--json", env=env)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == n and out.endswith("\n"), (len(lines), out[-200:])
    assert [json.loads(line)["offset"] for line in lines] == list(range(n))
    code, out, err, _ = raymq("--namespace", ns, "consume", "nowhere", env=env)
    assert code == 1 and out == "" and err.startswith("raymq: error: "), err


def test_deleting_asks_on_a_terminal(ns, tmp_path, gcs_address):
    """unsubscribe and delete-address say what is lost and ask on a terminal; with no
    terminal (a script) and no --yes they refuse, in one line."""
    for args in (["create-address", "ev"], ["subscribe", "ev", "s"], ["send", "ev", "x"]):
        assert main(["--namespace", ns, *args]) == 0
    env = auto_env(tmp_path, gcs_address)
    code, out, err = on_a_terminal("--namespace", ns, "unsubscribe", "ev", "s", answer="n", env=env)
    assert code == 1 and out == "" and ray_lines(err) == [], err
    assert "delete subscription 'ev/s': 1 unacknowledged message(s), 0 consumer(s)? [y/N]" in err
    assert err.rstrip().endswith("raymq: aborted")
    code, out, err, _ = raymq("--namespace", ns, "unsubscribe", "ev", "s", env=env)  # no tty
    assert code == 1 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("raymq: error: not deleting subscription 'ev/s'") and "--yes" in err
    code, out, err = on_a_terminal("--namespace", ns, "unsubscribe", "ev", "s", answer="y", env=env)
    assert code == 0 and ray_lines(err) == [], err
    assert out == "subscription 'ev/s' deleted, with 1 unacknowledged message(s)\n"
    code, out, err = on_a_terminal("--namespace", ns, "delete-address", "ev", answer="y", env=env)
    assert code == 0 and ray_lines(err) == [], err
    assert "delete address 'ev': 0 stored message(s), 0 subscription(s) (none)? [y/N]" in err
    assert out == "address 'ev' deleted, with 0 subscription(s) and 0 stored message(s)\n"


def test_verbose_lets_ray_speak(ns, tmp_path, gcs_address):
    """The check above is not vacuous: with --verbose, Ray's lines show on this path."""
    env = auto_env(tmp_path, gcs_address)
    if "RAY_AUTH_MODE" in env:
        pytest.skip("the suite's Ray runs without token authentication: no banner to see")
    code, _, err, _ = raymq("--verbose", "--namespace", ns, "status", env=env)
    assert code == 0 and ray_lines(err), err


def test_an_unreachable_address_fails_fast_in_one_line():
    code, _, _, start_up = raymq("--help", env=base_env())
    assert code == 0
    address = f"127.0.0.1:{free_port()}"
    code, out, err, took = raymq("--address", address, "status", env=base_env())
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("raymq: error: cannot reach Ray at")
    assert repr(address) in err and "ray start --head" in err
    assert took - start_up < FAIL_FAST_SECONDS, (took, start_up)


def test_a_refused_token_fails_fast_in_one_line(ray_session, gcs_address):
    if os.environ.get("RAY_AUTH_MODE") != "token":
        pytest.skip("the suite's Ray runs without token authentication")
    env = base_env()
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env["RAY_AUTH_TOKEN"] = "0" * 32  # not the cluster's
    code, out, err, took = raymq("--address", gcs_address, "status", env=env, timeout=60)
    assert code == 1 and out == "" and len(err.splitlines()) == 1, err
    assert "refused this process's authentication token" in err and gcs_address in err
    assert took < 30  # Ray alone retries 20 times


# -- the pieces, in-process -------------------------------------------------------------


def test_no_cluster_suggests_ray_start(monkeypatch):
    """`--address auto` with no Ray on the machine (tested without a subprocess: this
    machine runs the suite's Ray, which auto would find)."""
    import ray._private.services

    def nothing_running(address, temp_dir=None):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray._private.services, "canonicalize_bootstrap_address", nothing_running)
    with pytest.raises(BrokerUnavailable) as caught:
        _cli_ray.resolve("auto")
    text = str(caught.value)
    assert text.startswith("cannot reach Ray at 'auto'") and "`ray start --head`" in text
    assert "ray start --head" in _cli_ray.unreachable_message("auto", "h:1", "refused")


def test_init_failure_messages(monkeypatch):
    log = "[2026-11-23 17:46:18,241 W 1 1] gcs_client.cc:210: Unauthenticated: InvalidAuthToken"
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    text = _cli_ray.init_failure_message("h:1", ConnectionError("Failed"), log)
    assert "sends none" in text and "RAY_AUTH_MODE=token" in text and "'h:1'" in text
    text = _cli_ray.init_failure_message("h:1", ConnectionError("Failed to\nconnect"), "")
    assert text == "cannot reach Ray at 'h:1': Failed to connect"


def test_split_host_port():
    assert _cli_ray.split_host_port("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert _cli_ray.split_host_port("[fd00::2]:6379") == ("fd00::2", 6379)
    assert _cli_ray.split_host_port("ray://head:10001") == ("head", 10001)
    assert _cli_ray.split_host_port("auto") is None


def test_captured_stderr_fd_keeps_cxx_lines_and_lets_python_through(capfd):
    with _cli_ray.captured_stderr_fd() as captured:
        os.write(2, b"[2026-01-01 00:00:00,000 W 1 1] rpc_client.h:1: noise\n")
        print("raymq: error: kept", file=sys.stderr)
    assert captured == ["[2026-01-01 00:00:00,000 W 1 1] rpc_client.h:1: noise\n"]
    err = capfd.readouterr().err
    assert "kept" in err and "noise" not in err


def test_join_ray_leaves_a_process_that_set_up_ray_alone(ray_session):
    before = logging.getLogger("ray").level
    _cli_ray.join_ray("auto", "any")  # already connected: nothing to do
    assert logging.getLogger("ray").level == before
