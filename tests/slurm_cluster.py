"""The two-node SLURM the ``slurm`` tests run on (scripts/local_slurm.sh ``--nodes 2``), and their helpers.

The cluster starts once per session (per xdist worker) in a temporary folder and stops at the
session's end. Where slurm-wlm, munge or iproute2 is missing, or this is not root, the tests skip with
the reason; ``VITEXP_REQUIRE_SLURM=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("sbatch", "srun", "scontrol", "scancel", "squeue", "slurmctld", "slurmd", "munged", "ip", "nsenter")


def missing() -> list[str]:
    """What the cluster needs and this machine lacks, in words."""
    gone = [t for t in TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    if os.geteuid() != 0:
        gone.append("root (slurmd starts jobs as their user)")
    return gone


@dataclass
class Cluster:
    folder: Path
    conf: Path

    def env(self, results: Path, **extra: str) -> dict[str, str]:
        """A job's environment (sbatch passes the submitter's on): this cluster, results under
        ``results``, W&B off, the interpreter's scripts first on PATH, this checkout importable."""
        env = dict(os.environ)
        env.update(
            SLURM_CONF=str(self.conf),
            VITEXP_RESULTS=str(results),
            WANDB_MODE="disabled",
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            **extra,
        )
        for var in [v for v in env if v.startswith("SLURM_") and v != "SLURM_CONF"]:
            env.pop(var)  # a test run inside a SLURM job must not pass its own job on
        return env

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``{}`` once SLURM has forgotten the job)."""
        out = subprocess.run(
            ["scontrol", "show", "job", job_id],
            env={**os.environ, "SLURM_CONF": str(self.conf)},
            capture_output=True,
            text=True,
        ).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float = 600, restarts: int = 0) -> dict[str, str]:
        """Wait until the job has ended after ``restarts`` requeues; its final fields."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if (
                info.get("JobState")
                in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
                and int(info.get("Restarts", 0)) >= restarts
            ):
                return info
            time.sleep(1)
        raise AssertionError(
            f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s; logs in"
            f" {self.folder}/log"
        )


def start(folder: Path, nodes: int = 2) -> Cluster:
    """The guide's start line for one node or two, run as written in ``folder``."""
    from doc_commands import run_doc

    env = {**os.environ, "PATH": f"{os.environ['PATH']}{os.pathsep}/usr/sbin"}
    fill, options = {"<folder>": str(folder)}, {"env": env, "cwd": ROOT, "timeout": 120}
    if nodes == 2:
        done = run_doc("bash scripts/local_slurm.sh start <folder> --nodes 2", fill, **options)
    else:
        done = run_doc("bash scripts/local_slurm.sh start <folder>", fill, **options)
    if done.returncode != 0:  # the script stopped what it had started
        logs = "".join(p.read_text()[-1500:] for p in sorted((folder / "log").glob("*.log")))
        raise RuntimeError(f"the {nodes}-node SLURM did not start: {done.stderr[-1500:]}\n{logs}")
    assert done.stdout.strip().splitlines()[-1] == f"export SLURM_CONF={folder}/slurm.conf", done.stdout
    return Cluster(folder, folder / "slurm.conf")


def stop(cluster: Cluster) -> None:
    from doc_commands import run_doc

    done = run_doc(
        "bash scripts/local_slurm.sh stop <folder>",
        {"<folder>": str(cluster.folder)},
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PATH": f"{os.environ['PATH']}{os.pathsep}/usr/sbin"},
    )
    assert done.returncode == 0, done.stderr[-1500:]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The two-node cluster of this session (module docstring)."""
    gone = missing()
    if gone:
        reason = (
            f"no two-node SLURM here: missing {', '.join(gone)}"
            " (as root: apt-get install -y slurm-wlm munge iproute2)"
        )
        if os.environ.get("VITEXP_REQUIRE_SLURM") == "1":
            pytest.fail(f"{reason}; VITEXP_REQUIRE_SLURM=1 requires it")
        pytest.skip(reason)
    cluster = start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    stop(cluster)
