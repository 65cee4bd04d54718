"""Isolating one process's CPU for a benchmark: pin every thread of a process to CPUs, or cap
a process at a fraction of one core with a CPU cgroup (v1 or v2; root only). Used by
`pdserve bench router-saturation`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (sched_setaffinity on a pid moves only its main thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def pin_router_alone(cluster: Any) -> dict[str, list[int]]:
    """The router on the machine's first CPU, every other process (and this one) on the
    others (all of the machine's, whatever affinity this process was started with)."""
    cpus = list(range(os.cpu_count() or 1))
    if len(cpus) < 2:
        raise SystemExit("--pin-router needs at least 2 CPUs")
    router_cpus, rest = {cpus[0]}, set(cpus[1:])
    for name, proc in cluster.processes.items():
        if proc.popen is not None:
            pin_process(proc.popen.pid, router_cpus if name == "router" else rest)
    pin_process(os.getpid(), rest)
    return {"router": sorted(router_cpus), "others": sorted(rest)}


CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_PERIOD_US = 100_000


def cap_cpu(pid: int, fraction: float, name: str) -> Path:
    """Move process `pid` (every thread) into a new CPU cgroup capped at `fraction` of one
    core; returns the cgroup's directory (remove it with `uncap`)."""
    quota = max(1000, int(fraction * CGROUP_PERIOD_US))
    v2 = (CGROUP_V2 / "cgroup.controllers").exists()
    if v2 and "cpu" not in (CGROUP_V2 / "cgroup.subtree_control").read_text().split():
        raise SystemExit("--router-cpu-quota: the cgroup v2 cpu controller is not enabled")
    group = (CGROUP_V2 if v2 else CGROUP_V1_CPU) / name
    try:
        group.mkdir(exist_ok=True)
        if v2:
            (group / "cpu.max").write_text(f"{quota} {CGROUP_PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(CGROUP_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        raise SystemExit(f"--router-cpu-quota needs a writable CPU cgroup (root): {exc}") from exc
    return group


def uncap(group: Path) -> None:
    """Remove a cgroup made by `cap_cpu` (its processes have exited or are moved out)."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)  # the router is still exiting
