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
  (:func:`vitexp.config.composition.run_stamp`), which the requeued job (same id) finds again; with
  ``hydra.run.dir`` set, the same folder is whatever it names.
- Hydra's submitit launcher (``hydra/launcher=slurm``) warns with SIGUSR2 and requeues through
  submitit itself: submitit's handler pickles the job again, runs ``scontrol requeue`` and raises
  ``SystemExit(-1)`` inside the run (rank 0; other ranks return and go on until SLURM stops them).
  :func:`note_submitit_requeue` wraps that handler so the run notes the signal first: the entry then
  closes ``interrupted`` (``SIGUSR2``, ``requeued``: submitit's requeue), never ``failed``, and vitexp
  asks SLURM nothing itself. Where submitit declines (timed out too often, not checkpointable) the run
  is still ``interrupted``, with no ``requeued``. The SIGTERMs that follow the requeue arrive while
  the entry closes and are only noted (:mod:`vitexp.runs.signals`); a SIGUSR2 that arrives then is
  noted too, and submitit's handler is not called (a completed run is never requeued).

A job's resources under ``hydra/launcher=slurm`` follow its trainer (:func:`resources`): a GPU
trainer asks one task and 10 CPUs per GPU (``trainer.devices`` GPUs per node, 64 GB); a CPU trainer
asks no GPU, one CPU per task and 4 GB, one task per DDP process (``trainer=ddp_cpu``: 2), so the
CPU demo never holds a GPU node. ``hydra.launcher.<key>=...`` overrides any of them.
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
