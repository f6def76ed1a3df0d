"""A SLURM job's requeue before its time limit: SIGUSR1 → ``scontrol requeue $SLURM_JOB_ID``.

Its reasoning: docs/cluster.md, "vitexp/runs/slurm.py".
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess


def job_id() -> str | None:
    """``$SLURM_JOB_ID`` (an array task: ``$SLURM_ARRAY_JOB_ID_$SLURM_ARRAY_TASK_ID``), ``None`` outside
    SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def command() -> str:
    """What :func:`requeue` runs, in words (recorded under ``requeued`` in the entry it closes)."""
    return f"scontrol requeue {job_id()}"


def requeue() -> str:
    """``scontrol requeue <job>``; what it answered, in words (never raises: the run still closes)."""
    job = job_id()
    scontrol = shutil.which("scontrol")
    if job is None or scontrol is None:
        return f"not requeued: {'no $SLURM_JOB_ID' if job is None else 'scontrol is not on PATH'}"
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job} failed: {type(err).__name__}"
    if done.returncode != 0:
        return (
            f"scontrol requeue {job} failed (exit {done.returncode}):"
            f" {(done.stderr or done.stdout).strip()[:200]}"
        )
    return f"scontrol requeue {job}"


def plugins() -> list:
    """Lightning's ``SLURMEnvironment`` without its own requeue handler when Lightning finds a SLURM
    job (module docstring); nothing elsewhere."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


#: What a run interrupted by submitit's SIGUSR2 records under ``requeued``.
SUBMITIT_REQUEUE = "submitit: checkpoint and scontrol requeue"


def note_submitit_requeue(run) -> dict:
    """Inside a SLURM job whose SIGUSR2 handler is submitit's, wrap it (module docstring): the run's
    ``signal`` and ``requeued`` are set before submitit requeues and exits. Returns ``{SIGUSR2:
    submitit's handler}`` for the caller to restore (empty when nothing was wrapped)."""
    previous = signal.getsignal(signal.SIGUSR2)
    if job_id() is None or not callable(previous) or "submitit" not in getattr(previous, "__module__", ""):
        return {}

    def handler(signum, frame):
        if (
            run.entry_closing
        ):  # the entry is closing (completed, or interrupted by a first signal): noted, no requeue
            run.deferred.append("SIGUSR2")  # (vitexp.runs.signals)
            return
        run.signal, run.requeued = "SIGUSR2", SUBMITIT_REQUEUE
        try:
            previous(signum, frame)
        except Exception:  # submitit declined to requeue (UncompletedJobError): the run stops, not requeued
            run.requeued = None
            raise
        run.signal = run.requeued = None  # returned: a rank other than 0, which submitit leaves running

    signal.signal(signal.SIGUSR2, handler)
    return {signal.SIGUSR2: previous}


def resources(trainer) -> dict:
    """The SLURM resources of one job of ``trainer`` (its config: ``accelerator``, ``devices``,
    ``strategy``), the keys of ``conf/hydra/launcher/slurm.yaml`` that follow it (module docstring)."""
    from vitexp.errors import ConfigError

    accelerator, devices = str(trainer.get("accelerator", "cpu")), trainer.get("devices", 1)
    count = (
        len(devices)
        if isinstance(devices, (list, tuple))
        else int(devices)
        if str(devices).isdigit()
        else None
    )
    if accelerator in ("gpu", "cuda"):
        if count is None:
            raise ConfigError(
                f"trainer.devices={devices} with hydra/launcher=slurm: give the GPUs per node as a "
                "number (trainer.devices=8), as many tasks as GPUs are started on each node"
            )
        return {"gpus_per_node": count, "tasks_per_node": count, "cpus_per_task": 10, "mem_gb": 64}
    tasks = count if count and str(trainer.get("strategy", "auto")).startswith("ddp") else 1
    return {"gpus_per_node": None, "tasks_per_node": tasks, "cpus_per_task": 1, "mem_gb": 4}
