"""A local Ray head with its dashboard (and so the job server), the ``raymq`` command
against it, and every example submitted as a Ray job.

Run by ``tests/test_jobs.py`` in its own process; prints one JSON object of
observations on stdout. Usage: python tests/jobs_scenario.py RAY_TEMP_DIR EXAMPLE...
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import psutil
from ray.job_submission import JobStatus, JobSubmissionClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCLUDES = ["**/__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info"]  # .venv, .git: Ray


def raymq_cli(address: str, *args: str) -> subprocess.CompletedProcess:
    """Run the installed ``raymq`` script as a user would."""
    script = os.path.join(os.path.dirname(sys.executable), "raymq")
    # With an explicit address (another Ray runs here: the suite's), a driver sends the
    # cluster's token only when told to; `--address auto` alone finds it by itself.
    return subprocess.run(
        [script, "--address", address, "--namespace", "raymq-jobs", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_AUTH_MODE": "token"},
    )


def submit(client: JobSubmissionClient, entrypoint: str, runtime_env: dict) -> str:
    """Submit a job, retrying while the head's job agent is still starting (seconds)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def auth_token() -> str:
    """The token in ~/.ray/auth_token, made first if there is none: `ray start` uses it,
    and Ray's docs ask for one before a cluster is started other than by ``ray.init``."""
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    done = subprocess.run(
        [ray_cli, "get-auth-token", "--generate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_head(temp_dir: str) -> tuple[str, str]:
    """``ray start --head`` as a user would; returns (GCS address, dashboard URL)."""
    port, dashboard_port, agent_port = free_port(), free_port(), free_port()
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run(
        [
            ray_cli,
            "start",
            "--head",
            f"--port={port}",
            f"--dashboard-port={dashboard_port}",
            "--num-cpus=2",
            f"--object-store-memory={200 * 2**20}",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=true",
            # not the default 52365: another Ray on this machine (the suite's) may hold it
            f"--dashboard-agent-listen-port={agent_port}",
            "--disable-usage-stats",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
        # jobs run `python ...` from the PATH `ray start` had: make it this interpreter's
        env={
            **os.environ,
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        },
    )
    return f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}"


def stop_head(temp_dir: str) -> int:
    """Kill the processes of this head only (found by its temp dir): never ``ray stop``,
    which kills every Ray on the machine. Returns how many were killed."""
    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid != os.getpid() and any(temp_dir in p for p in proc.info["cmdline"] or []):
            mine.append(proc)
    for proc in mine:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(mine, timeout=10)
    return len(mine)


def main(temp_dir: str, examples: list[str]) -> dict:
    out: dict = {"auth_mode": os.environ.get("RAY_AUTH_MODE", "(default)"), "jobs": {}}
    token = auth_token()
    try:
        address, dashboard = start_head(temp_dir)
        paging = os.path.join(temp_dir, "paging")
        started = raymq_cli(address, "start", "--paging-directory", paging)
        out["start"] = {"code": started.returncode, "err": started.stderr[-2000:]}
        status = raymq_cli(address, "status", "--json")
        out["status"] = {"code": status.returncode, "err": status.stderr[-2000:]}
        if status.returncode == 0:
            out["status"]["json"] = json.loads(status.stdout)
        # The job server's HTTP API needs the cluster's token (`ray start` keeps it in
        # ~/.ray/auth_token); Ray drivers (the raymq command, the jobs) need nothing.
        client = JobSubmissionClient(dashboard, headers={"Authorization": f"Bearer {token}"})
        runtime_env = {"working_dir": ROOT, "excludes": EXCLUDES}
        for name in examples:
            t0 = time.monotonic()
            job = submit(client, f"python examples/{name}.py", runtime_env)
            while True:
                state = client.get_job_status(job)
                if state in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                    break
                if time.monotonic() - t0 > 300:
                    client.stop_job(job)
                    state = "TIMEOUT"
                    break
                time.sleep(0.5)
            info = client.get_job_info(job)
            out["jobs"][name] = {
                "status": str(state),
                "exit_code": getattr(info, "driver_exit_code", None),
                "seconds": round(time.monotonic() - t0, 1),
                "logs": client.get_job_logs(job)[-3000:],
            }
        stopped = raymq_cli(address, "stop")
        out["stop"] = {"code": stopped.returncode, "err": stopped.stderr[-2000:]}
        again = raymq_cli(address, "status")
        out["after_stop"] = {"code": again.returncode, "err": again.stderr.strip()}
        out["files_kept"] = os.path.isdir(paging)
    finally:
        out["killed"] = stop_head(temp_dir)
    return out


if __name__ == "__main__":
    os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    print(json.dumps(main(sys.argv[1], sys.argv[2:])))
