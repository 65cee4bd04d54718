"""The isolation tools of `bench router-saturation` (bench/isolation.py): pinning every thread
of a process, and capping a process's CPU with a cgroup (root only; skipped elsewhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench import isolation as rs

THREADED_SLEEPER = (
    "import threading, time\n"
    "ts = [threading.Thread(target=time.sleep, args=(30,), daemon=True) for _ in range(3)]\n"
    "[t.start() for t in ts]\n"
    "print('up', flush=True)\n"
    "time.sleep(30)\n"
)


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", THREADED_SLEEPER], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_pin_process_moves_every_thread(sleeper):
    cpu = min(os.sched_getaffinity(0))
    tids = [int(t.name) for t in Path(f"/proc/{sleeper.pid}/task").iterdir()]
    assert len(tids) >= 4  # the main thread and three others
    rs.pin_process(sleeper.pid, {cpu})
    assert {tid: os.sched_getaffinity(tid) for tid in tids} == {tid: {cpu} for tid in tids}


def _cpu_cgroup_writable() -> bool:
    if os.geteuid() != 0:
        return False
    if (rs.CGROUP_V2 / "cgroup.controllers").exists():
        return "cpu" in (rs.CGROUP_V2 / "cgroup.subtree_control").read_text().split()
    return os.access(rs.CGROUP_V1_CPU, os.W_OK)


@pytest.mark.skipif(not _cpu_cgroup_writable(), reason="no writable CPU cgroup (needs root)")
def test_cap_cpu_puts_the_process_in_a_capped_group_and_uncap_removes_it(sleeper):
    group = rs.cap_cpu(sleeper.pid, 0.25, f"pdserve-test-{os.getpid()}")
    try:
        if (group / "cpu.max").exists():
            assert (group / "cpu.max").read_text().split() == ["25000", "100000"]
        else:
            assert (group / "cpu.cfs_quota_us").read_text().strip() == "25000"
            assert (group / "cpu.cfs_period_us").read_text().strip() == "100000"
        members = {int(x) for x in (group / "cgroup.procs").read_text().split()}
        assert sleeper.pid in members
        # every thread went with the process
        tasks = (
            {int(x) for x in (group / "tasks").read_text().split()}
            if (group / "tasks").exists()
            else {int(t.name) for t in Path(f"/proc/{sleeper.pid}/task").iterdir()}
        )
        assert {int(t.name) for t in Path(f"/proc/{sleeper.pid}/task").iterdir()} <= tasks
    finally:
        sleeper.kill()
        sleeper.wait()
        rs.uncap(group)
    assert not group.exists()
