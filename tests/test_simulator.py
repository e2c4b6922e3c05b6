"""The seeded fault simulator (``raymq.sim``): a fixed set of seeds runs here, every
invariant checked after every step; ``make fuzz SEEDS=N`` runs many more. A failing
seed's message holds the command that replays it."""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys
import types

import pytest

from raymq.sim.disk import SimDisk
from raymq.sim.run import Violation, repro_command, run_seed

#: Chosen to cover every kind of run the seeds draw: crashes, rot, full disks, I/O
#: errors, selectors, restarts (see ``Settings.draw``).
FIXED_SEEDS = list(range(12))


@functools.cache
def _run(seed: int) -> dict:
    return run_seed(seed, steps=300)


@pytest.mark.parametrize("seed", FIXED_SEEDS)
def test_a_fixed_seed_holds_every_invariant(seed):
    try:
        summary = _run(seed)
    except Violation as exc:
        pytest.fail(f"{exc}\nreproduce: {repro_command(seed, 300)}")
    assert summary["served"] > 0 and summary["stored"] > 0


def test_the_fixed_seeds_crash_rot_and_fail_calls():
    """The fixed seeds exercise what they are meant to (else they prove little)."""
    totals: dict[str, int] = {}
    for seed in FIXED_SEEDS:
        for k, v in _run(seed).items():
            totals[k] = totals.get(k, 0) + v
    assert totals["crashes"] > 0
    assert totals["flips"] > 0 and totals["damaged"] > 0
    assert totals["injected_errors"] > 0
    assert totals["restarts"] > 0


def test_the_simulator_finds_a_writer_that_does_not_sync(monkeypatch):
    """With segment fdatasyncs skipped (a broken writer), seeds break invariants."""
    import raymq.storage.writer as writer

    class NoSync(types.ModuleType):
        def __getattr__(self, name):
            return (lambda fd: None) if name == "fdatasync" else getattr(os, name)

    monkeypatch.setattr(writer, "os", NoSync("os"))
    broken = 0
    for seed in range(8):
        try:
            run_seed(seed, steps=300)
        except Violation:
            broken += 1
    assert broken >= 2


def test_a_crash_image_keeps_what_was_synced_and_may_lose_the_rest(tmp_path):
    disk = SimDisk(str(tmp_path), random.Random(7))
    path = str(tmp_path / "f")
    with disk.installed():
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.write(fd, b"synced")
        os.fdatasync(fd)
        dfd = os.open(str(tmp_path), os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        os.write(fd, b"+unsynced")
        images = [disk.crash_image() for _ in range(40)]
        os.close(fd)
    contents = {img.files["f"] for img in images}
    assert all(c.startswith(b"synced") for c in contents)
    assert b"synced" in contents and b"synced+unsynced" in contents


def test_a_name_never_synced_in_its_directory_may_vanish(tmp_path):
    disk = SimDisk(str(tmp_path), random.Random(3))
    with disk.installed():
        fd = os.open(str(tmp_path / "new"), os.O_RDWR | os.O_CREAT, 0o600)
        os.write(fd, b"x")
        os.fdatasync(fd)  # its bytes, not its name
        images = [disk.crash_image() for _ in range(40)]
        os.close(fd)
    assert {("new" in img.files) for img in images} == {True, False}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_make_fuzz_and_the_replay_command_run_as_the_readme_says():
    fuzz = subprocess.run(
        ["make", "-s", "fuzz", "SEEDS=2", "FIRST=40"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert fuzz.returncode == 0, fuzz.stdout[-2000:] + fuzz.stderr[-2000:]
    assert "all 2 seeds held every invariant" in fuzz.stdout
    replay = repro_command(41, 60).split()
    assert replay[1:3] == ["-m", "raymq.sim"]
    one = subprocess.run(
        [sys.executable, *replay[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    assert "seed 41: ok" in one.stdout and "step 59:" in one.stdout
