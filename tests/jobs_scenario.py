"""The README's cluster path on a real local head, as a user types it.

1. The README's ``cluster-quickstart`` block, read out of README.md and run by bash as it
   is written: token, ``ray start --head``, ``raymq start``, ``ray job submit`` of the
   quickstart, ``raymq status``.
2. What the README promises then: the job's queue in the running broker (``raymq
   status --json``), token authentication on and the token file private
   (``raymq.auth.check_token_auth``), the other examples as Ray jobs joining the same
   broker, the job's queue on the metrics port, ``ray list actors``.
3. The README's ``cluster-commands`` block (``raymq create-queue``, ``send``,
   ``consume``, ``status``, ``stop``), then ``raymq status`` against a stopped broker.

What differs from a user's fresh machine, and only so that it runs beside the test
suite's own Ray and other Rays on this machine:

- ``HOME`` is a new empty directory: no ``~/.ray/auth_token`` yet (a fresh machine),
  and the broker's default paging directory is in it. It is removed at the end.
- ``RAY_TMPDIR`` is a new directory: ``ray start`` keeps its session there instead of
  /tmp/ray, and ``--address auto`` (``raymq``, ``ray job submit``, ``ray list``) finds
  this head through it.
- The ``ray start --head`` line gets free ports appended (``--port``,
  ``--dashboard-port``, ``--metrics-export-port`` instead of 8080,
  ``--dashboard-agent-listen-port``, ``--ray-client-server-port``): the defaults may be
  taken. The last value of a repeated option wins.
- ``source .venv/bin/activate`` sources the ``activate`` of the interpreter running
  this (the checkout's .venv under ``make test``).
- ``PYTHONUNBUFFERED=1``, so that each line is seen when it is written, for the timing.

Prints one JSON object of observations on stdout (the commands' output goes to
stderr as it comes). Usage: python tests/jobs_scenario.py [--dirs HOME RAY_TMPDIR] EXAMPLE...
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BIN = os.path.dirname(sys.executable)
#: The quickstart's first line in the broker: the moment measured from ``ray start``.
FIRST_MESSAGE_LINE = "sent one message at offset"
#: Seconds every submitted example has to end (they run side by side on the head's 2
#: CPUs, so one may wait for another's; 300 timed out Spark's example on a loaded CI).
JOB_SECONDS = 600


def fenced(name: str, readme: str = README) -> str:
    """The text of README's fenced block opened with ```` ```NAME ```` (e.g. "python
    addresses", "bash cluster-quickstart")."""
    with open(readme) as f:
        text = f.read()
    m = re.search(rf"^```{re.escape(name)}\n(.*?)^```\s*$", text, re.S | re.M)
    if m is None:
        raise LookupError(f"README.md has no ```{name} block")
    return m.group(1)


def readme_block(tag: str, readme: str = README) -> list[str]:
    """The lines of README's fenced block opened with ```` ```bash TAG ````."""
    return [line for line in fenced(f"bash {tag}", readme).splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def adapt(lines: list[str], ports: dict[str, int]) -> list[str]:
    """The block's lines with this machine's deviations (see the module docstring)."""
    out = []
    for line in lines:
        command = re.sub(r"\s+#.*$", "", line)
        if "ray start --head" in command:
            command += "".join(f" --{k}={v}" for k, v in ports.items())
        if command.split()[:2] == ["source", ".venv/bin/activate"]:
            activate = os.path.join(BIN, "activate")
            command = (
                f"source {shlex.quote(activate)}"
                if os.path.isfile(activate)
                else f"export PATH={shlex.quote(BIN)}:$PATH"
            )
        out.append(command)
    return out


def run_bash(lines: list[str], env: dict, timeout: float) -> dict:
    """Run ``lines`` as one bash script (-e, -x), from the checkout; each output line
    is time-stamped (monotonic) as it arrives. Returns the exit code, the lines with
    their stamps, and the commands bash started with their stamps."""
    script = "set -eo pipefail\nset -x\n" + "\n".join(lines) + "\n"
    proc = subprocess.Popen(
        ["bash", "--noprofile", "--norc", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    seen: list[tuple[float, str]] = []

    def read() -> None:
        for raw in proc.stdout:
            seen.append((time.monotonic(), raw.rstrip("\n")))
            print(raw, end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "TIMEOUT"
    reader.join(timeout=10)
    # xtrace: "+ command" as bash starts each command ("++" for nested ones)
    starts = [(stamp, text[2:]) for stamp, text in seen if text.startswith("+ ")]
    return {"code": code, "lines": seen, "starts": starts}


def output_of(result: dict) -> str:
    return "\n".join(text for _stamp, text in result["lines"])


def raymq_cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    """The installed ``raymq`` script, in the block's environment."""
    return subprocess.run(
        [os.path.join(BIN, "raymq"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


def check_auth(env: dict) -> dict:
    """``raymq.auth.check_token_auth`` from a driver joined to the head, the token file
    made readable by others first (as Ray writes it)."""
    token = os.path.join(env["HOME"], ".ray", "auth_token")
    os.chmod(token, 0o644)
    code = (
        "import dataclasses, json, raymq, raymq.auth\n"
        "raymq.connect(address='auto', create=False)\n"
        "status = dataclasses.asdict(raymq.auth.check_token_auth())\n"
        "status['dashboard_answer'] = raymq.auth._ask_dashboard()\n"
        "print(json.dumps(status))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    out = {"code": done.returncode, "err": done.stderr[-2000:]}
    if done.returncode == 0:
        out["status"] = json.loads(done.stdout.strip().splitlines()[-1])
    out["file_mode"] = oct(os.stat(token).st_mode & 0o777)
    return out


def submit_jobs(env: dict, dashboard: str, examples: list[str]) -> dict:
    """Each example as a Ray job (working dir examples/), all submitted at once (as a
    team's jobs arrive) and waited for together."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    with open(os.path.join(env["HOME"], ".ray", "auth_token")) as f:
        token = f.read().strip()
    client = JobSubmissionClient(dashboard, headers={"Authorization": f"Bearer {token}"})
    runtime_env = {"working_dir": os.path.join(ROOT, "examples")}
    t0 = time.monotonic()
    submitted = {
        name: client.submit_job(entrypoint=f"python {name}.py", runtime_env=runtime_env)
        for name in examples
    }
    ended = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)
    states: dict[str, object] = {}
    seconds: dict[str, float] = {}
    while len(states) < len(submitted):
        for name, job in submitted.items():
            if name in states:
                continue
            state = client.get_job_status(job)
            if state not in ended and time.monotonic() - t0 > JOB_SECONDS:
                client.stop_job(job)
                state = "TIMEOUT"
            if state in ended or state == "TIMEOUT":
                states[name], seconds[name] = state, round(time.monotonic() - t0, 1)
        time.sleep(0.5)  # the pace of polling the job server
    jobs = {}
    for name, job in submitted.items():
        info = client.get_job_info(job)
        logs = client.get_job_logs(job)
        jobs[name] = {
            "joined": "joined the running RayMQ broker" in logs,
            "status": str(states[name]),
            "exit_code": getattr(info, "driver_exit_code", None),
            "seconds": seconds[name],
            "logs": logs[-3000:],
        }
    return jobs


def scrape(port: int, queue: str, wait: float = 40.0) -> dict:
    """``ray_raymq_queue_messages_in`` of ``queue`` on the metrics port, polled until it
    appears (Ray reports about every 10 s)."""
    pattern = re.compile(r"^ray_raymq_queue_messages_in\{([^}]*)\}\s+(\S+)", re.M)
    deadline = time.monotonic() + wait
    text = ""
    while time.monotonic() < deadline:
        url = f"http://127.0.0.1:{port}/metrics"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        for labels, value in pattern.findall(text):
            if f'queue="{queue}"' in labels:
                return {"labels": labels, "value": float(value)}
        time.sleep(1)
    return {
        "labels": None,
        "value": None,
        "names": sorted(set(re.findall(r"^ray_raymq_\w+", text, re.M))),
    }


def stop_head(marker: str) -> int:
    """Kill this head's processes only: those whose command line names ``marker`` (its
    temp dir) and everything they started (workers, agents, job drivers, whose titles
    no longer name it). Never ``ray stop``: it kills every Ray on the machine."""
    mine: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid != os.getpid() and any(marker in p for p in proc.info["cmdline"] or []):
            mine[proc.pid] = proc
            with contextlib.suppress(psutil.Error):
                mine.update((c.pid, c) for c in proc.children(recursive=True))
    for proc in mine.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(mine.values()), timeout=10)
    return len(mine)


def scratch_dirs() -> tuple[str, str]:
    """(HOME, RAY_TMPDIR) for a run: directories of their own, not pytest's tmp_path (no
    cleanup of another pytest session on this machine can reach them while the head
    runs); short, since Ray's socket paths live in RAY_TMPDIR."""
    return tempfile.mkdtemp(prefix="rmq-home-"), tempfile.mkdtemp(prefix="rmq-jobs-")


def clean_up(home: str, ray_tmp: str) -> int:
    """Stop the head of ``ray_tmp`` and remove both directories; how many processes."""
    killed = stop_head(ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    return killed


def main(examples: list[str], home: str, ray_tmp: str) -> dict:
    ports = {
        "port": free_port(),
        "dashboard-port": free_port(),
        "metrics-export-port": free_port(),
        "dashboard-agent-listen-port": free_port(),
        "ray-client-server-port": free_port(),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=home, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    env.pop("VIRTUAL_ENV", None)
    out: dict = {"ports": ports, "examples": examples}
    quickstart = readme_block("cluster-quickstart")
    commands = readme_block("cluster-commands")
    try:
        t0 = time.monotonic()
        block = run_bash(adapt(quickstart, ports), env, timeout=JOB_SECONDS)
        out["quickstart_block"] = {
            "lines": quickstart,
            "code": block["code"],
            "output": output_of(block)[-6000:],
        }
        # Timing, from the moment bash starts `ray start --head` to the job's first
        # message stored (the job's line, as `ray job submit` shows it).
        commands_run = block["starts"]
        head = next((i for i, (_s, c) in enumerate(commands_run) if "ray start --head" in c), None)
        first = next((s for s, text in block["lines"] if FIRST_MESSAGE_LINE in text), None)
        if head is not None and first is not None:
            head_started = commands_run[head][0]
            following = commands_run[head + 1 : head + 2]
            out["timing"] = {
                "head_start_to_first_message_s": round(first - head_started, 1),
                "head_start_to_ready_s": round(following[0][0] - head_started, 1)
                if following
                else None,
                "block_s": round(block["lines"][-1][0] - t0, 1),
            }
        # The shell the block leaves: its exports, and the venv it activated.
        shell = [line for line in adapt(quickstart, ports) if line.startswith(("export", "source"))]
        env_after = dict(env, RAY_AUTH_MODE="token", PATH=BIN + os.pathsep + env["PATH"])
        status = raymq_cli(env_after, "status", "--json")
        out["status"] = {"code": status.returncode, "err": status.stderr[-2000:]}
        if status.returncode == 0:
            out["status"]["json"] = json.loads(status.stdout)
        out["auth"] = check_auth(env_after)
        dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
        out["jobs"] = submit_jobs(env_after, dashboard, [e for e in examples if e != "quickstart"])
        after = raymq_cli(env_after, "status", "--json")
        out["status_after_jobs"] = {"code": after.returncode, "err": after.stderr[-2000:]}
        if after.returncode == 0:
            out["status_after_jobs"]["json"] = json.loads(after.stdout)
        out["metrics"] = scrape(ports["metrics-export-port"], "example.orders")
        actors = subprocess.run(
            [os.path.join(BIN, "ray"), "list", "actors"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env_after,
        )
        out["ray_list_actors"] = {
            "code": actors.returncode,
            "names": sorted(set(re.findall(r"\braymq\.[\w.]+", actors.stdout))),
            "err": actors.stderr[-2000:],
        }
        # A driver on the head's machine (not a job), after the metrics were read: it
        # adds to the quickstart job's queue.
        joined = subprocess.run(
            [os.path.join(BIN, "python"), "examples/quickstart.py", "--join"],
            capture_output=True,
            text=True,
            timeout=JOB_SECONDS,
            env=env_after,
            cwd=ROOT,
        )
        out["join_flag"] = {"code": joined.returncode, "out": joined.stdout[-3000:]}
        out["join_flag"]["err"] = joined.stderr[-3000:]
        cmds = run_bash(shell + adapt(commands, ports), env, timeout=300)
        out["commands_block"] = {
            "lines": commands,
            "code": cmds["code"],
            "output": output_of(cmds)[-6000:],
            "consumed": [text for _s, text in cmds["lines"] if text.startswith('{"offset"')],
        }
        again = raymq_cli(env_after, "status")
        out["after_stop"] = {"code": again.returncode, "err": again.stderr.strip()[-2000:]}
        out["files_kept"] = os.path.isdir(os.path.join(home, ".raymq", "paging", "example.orders"))
    finally:
        out["killed"] = clean_up(home, ray_tmp)
    return out


if __name__ == "__main__":
    os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    args = sys.argv[1:]
    if args[:1] == ["--dirs"]:  # HOME RAY_TMPDIR made (and cleaned up) by the caller
        home, ray_tmp, examples = args[1], args[2], args[3:]
    else:
        (home, ray_tmp), examples = scratch_dirs(), args
    print(json.dumps(main(examples, home, ray_tmp)))
