"""How many CPUs this process may use, and torch's compute threads fitted to them.

Its reasoning: docs/cluster.md, "vitexp/runs/cpus.py".
"""

from __future__ import annotations

import math
import os
from pathlib import Path

#: Where the cgroup quota is read (v2, then v1).
CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def _quota(v2: Path = CGROUP_V2, v1: tuple[Path, Path] = CGROUP_V1) -> int | None:
    """The cgroup's CPU quota rounded up to whole CPUs, ``None`` when it sets none or cannot be read."""
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            if quota != "max":
                return max(1, math.ceil(int(quota) / int(period)))
            return None
        if v1[0].is_file() and v1[1].is_file():
            quota, period = int(v1[0].read_text()), int(v1[1].read_text())
            return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_cpus(v2: Path = CGROUP_V2, v1: tuple[Path, Path] = CGROUP_V1) -> int:
    """The CPUs this process may use: the fewest of its affinity mask and its cgroup's quota."""
    try:
        counts = [len(os.sched_getaffinity(0))]
    except AttributeError:  # not on Linux
        counts = [os.cpu_count() or 1]
    quota = _quota(v2, v1)
    if quota is not None:
        counts.append(quota)
    return max(1, min(counts))


def fit_threads(v2: Path = CGROUP_V2, v1: tuple[Path, Path] = CGROUP_V1) -> int:
    """Lower torch's intra-op threads to :func:`available_cpus` when they exceed it (unless
    ``OMP_NUM_THREADS`` is set); the thread count in use after."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        cpus = available_cpus(v2, v1)
        if torch.get_num_threads() > cpus:
            torch.set_num_threads(cpus)
    return torch.get_num_threads()
