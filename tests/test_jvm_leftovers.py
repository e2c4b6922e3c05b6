"""Which /tmp files of JVMs a Spark session removes (``raymq.jvm_leftovers``), without
Spark: the files are made here, the processes are this test's own children."""

from __future__ import annotations

import subprocess
import sys

from raymq.jvm_leftovers import SessionJvms, owned_pids


def test_only_the_files_of_the_sessions_dead_jvms_are_removed(tmp_path):
    ours_dead = tmp_path / "ray" / "1795924854373"
    theirs = tmp_path / "ray" / "1795924868972"  # newer than ours: another process's
    for d in (ours_dead, theirs):
        d.mkdir(parents=True)
        (d / "libcore_worker_library_java.so").write_bytes(b"x")
    lz4 = tmp_path / "liblz4-java-1.so"
    lz4.write_bytes(b"x")
    (tmp_path / "liblz4-java-1.so.lck").write_bytes(b"")
    perf = tmp_path / "hsperfdata_someone"
    perf.mkdir()
    live = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        dead_pid = int(dead.stdout)
        (perf / str(dead_pid)).write_bytes(b"x")
        (perf / str(live.pid)).write_bytes(b"x")  # a JVM of ours still running: kept
        session = SessionJvms(
            {dead_pid, live.pid},
            {
                str(ours_dead),
                str(lz4),
                f"{lz4}.lck",
                str(perf / str(dead_pid)),
                str(perf / str(live.pid)),
            },
        )
        removed = session.remove()
        assert sorted(removed) == sorted(
            [str(ours_dead), str(lz4), f"{lz4}.lck", str(perf / str(dead_pid))]
        )
        assert theirs.exists()
        assert (perf / str(live.pid)).exists()
        assert session.files == {str(perf / str(live.pid))}
        assert session.alive() == [live.pid]
    finally:
        live.kill()
        live.wait()
    assert session.remove() == [str(perf / str(live.pid))]


def test_the_sessions_processes_are_found_through_the_jobs_their_drivers_run():
    tree = {100: [101], 200: [201], 300: [301], 900: [901]}

    def children(pid: int) -> set[int]:
        """Children and grandchildren (the tree is two deep)."""
        kids = set(tree.get(pid, ()))
        return kids | {g for c in kids for g in tree.get(c, ())}

    jobs = [("01", 1), ("02", 201), ("03", 101), ("09", 901)]
    # Our driver (pid 1, job 01) has the app master's actor (200), whose child (201)
    # drives job 02, whose actors are the executors (300); the gateway (100) has a
    # child (101) driving job 03; job 09 and its actor (900) belong to someone else.
    actors = [("01", 200), ("02", 300), ("09", 900), ("03", None)]
    pids, our_jobs = owned_pids(1, 100, jobs, actors, children)
    assert pids == {100, 101, 200, 201, 300, 301}
    assert our_jobs == {"01", "02", "03"}
    # Without Ray's state API: the gateway and its descendants only.
    assert owned_pids(1, 100, [], [], children) == ({100, 101}, set())
