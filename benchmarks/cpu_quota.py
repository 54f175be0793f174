"""CPU limits and CPU time of benchmark processes (Linux, root): a fixed share of a core per process.

On a machine with fewer cores than processes, every process of a benchmark
competes for the same cores, so adding servers cannot add capacity. Giving each
server under test a CFS quota (``fraction`` of one core, in a cgroup of its own)
makes it the bottleneck on purpose: N of them then have N times the CPU, as N
servers on N machines would, and whether capacity follows is what the run shows.
Works with the cgroup v2 ``cpu.max`` file and with cgroup v1's ``cpu`` controller.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

PERIOD_US = 100_000
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cgroup_root() -> tuple[Path, bool]:
    """Where to make groups, and whether it is cgroup v2."""
    unified = Path("/sys/fs/cgroup")
    if (unified / "cgroup.controllers").exists() and "cpu" in (unified / "cgroup.controllers").read_text().split():
        return unified, True
    v1 = unified / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, False
    raise OSError("no cgroup cpu controller is mounted (cgroup v2 cpu.max or cgroup v1 cpu)")


@contextlib.contextmanager
def cpu_quota(pids: dict[str, int], fraction: float, prefix: str = "rollmesh-bench") -> Iterator[None]:
    """Hold each of ``pids`` (name -> pid) to ``fraction`` of one core while the block runs; the groups are
    removed after (their processes go back to the root group first)."""
    if not 0 < fraction <= 64:
        raise ValueError(f"fraction must be in (0, 64], got {fraction}")
    root, v2 = _cgroup_root()
    quota = max(1000, int(fraction * PERIOD_US))
    made: list[Path] = []
    try:
        for name, pid in pids.items():
            group = root / f"{prefix}-{name}-{os.getpid()}"
            group.mkdir()
            made.append(group)
            if v2:
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
            else:
                (group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
                (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (group / "cgroup.procs").write_text(f"{pid}\n")
        yield
    finally:
        for group in made:
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (root / "cgroup.procs").write_text(f"{pid}\n")
            with contextlib.suppress(OSError):
                group.rmdir()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS   # utime and stime, fields 14 and 15 of stat


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not waiting for I/O), over all cores."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _CLOCK_TICKS   # user..steal, less idle and iowait
