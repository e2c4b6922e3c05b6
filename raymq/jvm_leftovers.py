"""What the JVMs of one Spark-on-Ray session leave in /tmp, and removing it.

A JVM that loads Ray's Java worker extracts ``libcore_worker_library_java.so`` to
``/tmp/ray/<epoch ms>`` (about 40 MB), lz4-java extracts ``/tmp/liblz4-java-*.so``, and
every JVM writes ``/tmp/hsperfdata_<user>/<pid>``. A JVM that is killed (RayDP's
executors are) removes none of it. Other processes on the machine (another driver's
Spark, a Java Ray worker) make the same kinds of files, so what is removed is only what
the JVMs of this session were seen to use while they ran (``SessionJvms.find``), and
never a file a live process still maps.

A session's JVMs: the Spark driver JVM PySpark started (a child of this process), the
Ray jobs whose drivers are ours (RayDP's app master is the driver of a Ray job of its
own), and the actors of our jobs (RayDP's executors, Java actors of the app master's
job). Found through Ray's state API; where it does not answer, only this process's own
descendants count as ours.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: Where JVMs put their temporary files (``java.io.tmpdir``).
JAVA_TMP = "/tmp"
_RAY_LIBRARY = "libcore_worker_library_java.so"
_RAY_LIBRARY_DIR = re.compile(r"/ray/[0-9]{13}/" + re.escape(_RAY_LIBRARY) + "$")
_LZ4_LIBRARY = re.compile(r"/liblz4-java-[^/]*\.so$")


@dataclass
class SessionJvms:
    """The JVMs of one Spark session and the /tmp files they were seen to use."""

    pids: set[int] = field(default_factory=set)
    #: Ray library directories, lz4 libraries (with their ``.lck``) and perf data files.
    files: set[str] = field(default_factory=set)

    @classmethod
    def find(cls, gateway_pid: int | None, tmp: str = JAVA_TMP) -> SessionJvms:
        """This session's live JVMs and what they use; call while they run.
        ``gateway_pid``: PySpark's driver JVM, if it runs."""
        pids, jobs = owned_pids(os.getpid(), gateway_pid, *_ray_state())
        running = {int(os.path.basename(p)) for p in glob.glob(f"{tmp}/hsperfdata_*/[0-9]*")}
        # A Java worker of one of our jobs not (yet) running an actor: its job says so.
        jvms = {pid for pid in running if pid in pids or _job_of(pid) in jobs}
        found = cls(jvms)
        for pid in jvms:
            found.files.update(files_of(pid, tmp))
        return found

    def merge(self, other: SessionJvms) -> None:
        """Add what ``other`` found (a later look at the same session)."""
        self.pids |= other.pids
        self.files |= other.files

    def alive(self) -> list[int]:
        """The pids of this session's JVMs still running."""
        return [pid for pid in self.pids if alive(pid)]

    def remove(self) -> list[str]:
        """Remove the files of this session's JVMs that no live JVM of it uses and no
        live process maps; returns the paths removed."""
        running = {pid for pid in self.pids if alive(pid)}
        in_use = mapped_paths()
        removed = []
        for path in sorted(self.files):
            if _owner(path) in running or path in in_use:
                continue
            library = os.path.join(path, _RAY_LIBRARY)
            if os.path.isdir(path):
                if library in in_use:
                    continue
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    logger.warning("could not remove %s: %s", path, exc)
                    continue
            removed.append(path)
        self.files.difference_update(removed)
        return removed


def owned_pids(
    own_pid: int,
    gateway_pid: int | None,
    jobs: Iterable[tuple[str, int | None]],
    actors: Iterable[tuple[str, int | None]],
    children: Callable[[int], set[int]] | None = None,
) -> tuple[set[int], set[str]]:
    """The processes of this session, not counting this one: ``gateway_pid``, this
    process's descendants, and, to a fixed point, the actors of every job whose driver
    is one of ours, with their descendants. ``jobs``: ``(job id, driver pid)``;
    ``actors``: ``(job id, pid)``; ``children``: the descendants of a pid (default:
    from /proc, read once). Returns the pids and the ids of our jobs."""
    if children is None:
        tree = process_tree()
        children = lambda pid: subtree(tree, pid)  # noqa: E731
    ours = children(own_pid) | {own_pid}
    if gateway_pid is not None:
        ours |= {gateway_pid} | children(gateway_pid)
    jobs, actors = list(jobs), list(actors)
    our_jobs: set[str] = set()
    while True:
        new_jobs = {job for job, pid in jobs if pid in ours} - our_jobs
        our_jobs |= new_jobs
        more = {pid for job, pid in actors if job in our_jobs and pid is not None}
        more |= {pid for job, pid in jobs if job in our_jobs and pid is not None}
        for pid in more - ours:
            more |= children(pid)
        if not new_jobs and more <= ours:
            return ours - {own_pid}, our_jobs
        ours |= more


def _ray_state() -> tuple[list[tuple[str, int | None]], list[tuple[str, int | None]]]:
    """(job id, driver pid) of each job and (job id, pid) of each live actor, from
    Ray's state API; empty where it does not answer."""
    try:
        from ray.util.state import list_actors, list_jobs

        jobs = [
            (str(j.job_id), getattr(j.driver_info, "pid", None))
            for j in list_jobs(raise_on_missing_output=False)
            if j.job_id is not None
        ]
        actors = [
            (str(a.job_id), a.pid)
            for a in list_actors(
                filters=[("state", "=", "ALIVE")], limit=10_000, raise_on_missing_output=False
            )
        ]
    except Exception as exc:  # no dashboard, an older Ray: our descendants only
        logger.info("Ray's state API did not answer (%s): only our own JVMs are known", exc)
        return [], []
    return [(job, int(pid) if pid else None) for job, pid in jobs], actors


def files_of(pid: int, tmp: str = JAVA_TMP) -> set[str]:
    """The /tmp files of JVM ``pid`` (from its memory map and its perf data file)."""
    found: set[str] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.rsplit(None, 1)[-1]
            if not path.startswith(tmp + "/"):
                continue
            if _RAY_LIBRARY_DIR.search(path):
                found.add(os.path.dirname(path))
            elif _LZ4_LIBRARY.search(path):
                found.update((path, path + ".lck"))
    perf = _perf_file(pid, tmp)
    if perf is not None:
        found.add(perf)
    return found


def _job_of(pid: int) -> str | None:
    """The Ray job id a worker process runs for (its ``RAY_JOB_ID``), if any."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for entry in env:
        if entry.startswith(b"RAY_JOB_ID="):
            return entry[len(b"RAY_JOB_ID=") :].decode(errors="replace")
    return None


def _perf_file(pid: int, tmp: str) -> str | None:
    found = glob.glob(os.path.join(tmp, "hsperfdata_*", str(pid)))
    return found[0] if found else None


def _owner(path: str) -> int | None:
    """The pid a perf data file belongs to (None for other files)."""
    name = os.path.basename(path)
    return int(name) if "hsperfdata_" in path and name.isdigit() else None


def process_tree() -> dict[int, list[int]]:
    """Each live process's children, by pid (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(stat) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.split("/")[2]))
    return children


def subtree(children: dict[int, list[int]], pid: int) -> set[int]:
    """The processes started, directly or not, by ``pid`` in ``children``."""
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name, which is in parentheses.
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def mapped_paths() -> set[str]:
    """Files under /tmp mapped by live processes (a library in use is never removed)."""
    paths: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError), open(maps) as f:
            for line in f:
                if "/tmp/" in line:
                    paths.add(line.rsplit(None, 1)[-1])
    return paths
