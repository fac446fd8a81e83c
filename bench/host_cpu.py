"""What the host's CPU gave a benchmark run: the cgroup's CPU limit, how long the cgroup was
throttled, and the CPU seconds a process (the corpus server, the client child) used.

A device machine may report 16 CPUs while its container's quota allows fewer: a run whose
processes (the engine spinning on the GPU, the corpus client and server, the corpus' draft
threads) ask for more CPU than the quota is throttled in bursts, which looks like run-to-run noise.
Linux only (cgroup v2, with v1's cpu controller as a fallback); None where a file is missing."""

from __future__ import annotations

import os
from pathlib import Path

_V2 = Path("/sys/fs/cgroup")
_V1 = Path("/sys/fs/cgroup/cpu,cpuacct")


def cpu_limit() -> dict:
    """{"cpus": CPUs this process may run on, "quota_cpus": the cgroup's quota in CPUs (None: no
    quota or unknown)}."""
    out: dict = {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                 "quota_cpus": None}
    try:
        quota, period = (_V2 / "cpu.max").read_text().split()
        if quota != "max":
            out["quota_cpus"] = round(int(quota) / int(period), 2)
        return out
    except (OSError, ValueError):
        pass
    try:
        quota = int((_V1 / "cpu.cfs_quota_us").read_text())
        period = int((_V1 / "cpu.cfs_period_us").read_text())
        if quota > 0:
            out["quota_cpus"] = round(quota / period, 2)
    except (OSError, ValueError):
        pass
    return out


def throttled() -> tuple[int, float] | None:
    """(times throttled, seconds throttled) of this cgroup so far, or None."""
    for path, unit in ((_V2 / "cpu.stat", 1e-6), (_V1 / "cpu.stat", 1e-9)):
        try:
            fields = dict(line.split() for line in path.read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            continue
        key = "throttled_usec" if "throttled_usec" in fields else "throttled_time"
        if "nr_throttled" in fields and key in fields:
            return int(fields["nr_throttled"]), int(fields[key]) * unit
    return None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its waited-for children, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    # Fields after the command: state is index 0, utime 11, stime 12, cutime 13, cstime 14.
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks


class CpuWatch:
    """CPU figures over a span of a run: ``stop()`` returns the throttling in it and the CPU
    seconds each watched process used."""

    def __init__(self, pids: dict[str, int] | None = None) -> None:
        self.pids = dict(pids or {})
        self._t0 = throttled()
        self._cpu0 = {name: process_cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict:
        out: dict = {}
        t1 = throttled()
        if self._t0 is not None and t1 is not None:
            out["throttled_times"] = t1[0] - self._t0[0]
            out["throttled_ms"] = round((t1[1] - self._t0[1]) * 1e3, 1)
        for name, pid in self.pids.items():
            a, b = self._cpu0.get(name), process_cpu_seconds(pid)
            if a is not None and b is not None:
                out[f"{name}_cpu_s"] = round(b - a, 3)
        return out
