"""What the machine's CPUs did over a window: busy, stolen by the hypervisor, idle
(`/proc/stat`, in jiffies). A served run that reads slower than its simulation while the
engine probe reads the same machine is told apart by this: the host took cycles (steal) or
this guest's own processes competed (busy)."""

from __future__ import annotations

from pathlib import Path

FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat: Path = Path("/proc/stat")) -> dict[str, int] | None:
    """The aggregate `cpu` line's counters; None where there is no /proc/stat."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except OSError:
        return None
    return {k: int(v) for k, v in zip(FIELDS, first[1:], strict=False)}


def load_between(before: dict[str, int] | None, after: dict[str, int] | None
                 ) -> dict[str, float] | None:  # fmt: skip
    """Fractions of all CPU time in the window: busy (user, nice, system, irq, softirq),
    steal, and idle (idle + iowait)."""
    if not before or not after:
        return None
    d = {k: after[k] - before[k] for k in before if k in after}
    total = sum(d.values())
    if total <= 0:
        return None
    busy = sum(d.get(k, 0) for k in ("user", "nice", "system", "irq", "softirq"))
    idle = d.get("idle", 0) + d.get("iowait", 0)
    return {"busy": busy / total, "steal": d.get("steal", 0) / total, "idle": idle / total}
