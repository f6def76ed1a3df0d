"""A SLURM job's requeue before its time limit: SIGUSR1 → ``scontrol requeue $SLURM_JOB_ID``.

``sbatch --signal=USR1@120`` (or ``#SBATCH --signal=USR1@120``) warns a job two minutes before its
time limit. Inside a job (``$SLURM_JOB_ID`` set) a vitexp run then closes its ledger entry
``interrupted`` (signal ``SIGUSR1``, ``requeued``: the command), asks SLURM to requeue the job (every
rank asks, so one stuck in a collective does not stop it; ``scontrol requeue`` kills the job at once,
so the entry is closed first) and exits; SLURM starts the same command again, in the same run folder, and
``resume=auto`` (the default) reopens the same ledger entry and continues from
``checkpoints/<stage>/last.ckpt``.

Decisions:
- The run resumes from its last end-of-epoch checkpoint, not from a checkpoint taken at the
  signal: an epoch's end is where a resumed run sees the same batches and schedule as an
  uninterrupted one (the sampler draws each epoch from ``seed * SEED_STRIDE + epoch``), so the
  requeued run finishes with the uninterrupted run's metrics; the partial epoch is trained again.
  Lightning's own SLURM handler (which saves a mid-epoch ``hpc_ckpt`` that Lightning then resumes
  without the epoch's remaining order) is switched off: :func:`plugins`.
- The run's default folder inside a SLURM job is ``outputs/<name>/slurm-<job id>``
  (:func:`vitexp.config.run_stamp`), which the requeued job (same id) finds again; with
  ``hydra.run.dir`` set, the same folder is whatever it names.
- Hydra's submitit launcher (``hydra/launcher=slurm``) warns with SIGUSR2 and requeues through
  submitit itself; vitexp leaves SIGUSR2 to it.
"""
from __future__ import annotations

import os
import shutil
import subprocess


def job_id() -> str | None:
    """``$SLURM_JOB_ID`` (an array task: ``$SLURM_ARRAY_JOB_ID_$SLURM_ARRAY_TASK_ID``), ``None`` outside SLURM."""
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
        return f"scontrol requeue {job} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[:200]}"
    return f"scontrol requeue {job}"


def plugins() -> list:
    """Lightning's ``SLURMEnvironment`` without its own requeue handler when Lightning finds a SLURM
    job (module docstring); nothing elsewhere."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []
