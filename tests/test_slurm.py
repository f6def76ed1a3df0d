"""The SLURM code path without a cluster: Hydra's submitit_local launcher (the code path of
hydra/launcher=slurm) and SIGUSR1, SLURM's warning before a job's time limit, with a stand-in
``scontrol`` on PATH (vitexp.runs.slurm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli_env, ledger_entries, run_config

SMALL = [
    "data=synthetic",
    "data.num_train=64",
    "data.num_val=16",
    "data.num_test=32",
    "recipe.batch_size=16",
    "recipe.epochs=3",
    "recipe.warmup_epochs=0",
    "logger=none",
    "trainer.enable_progress_bar=false",
    "eval.throughput=false",
]


def _train(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vitexp.commands.cli",
        "train",
        *SMALL,
        "resume=auto",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def test_a_slurm_jobs_default_folder_is_named_by_its_job_id(monkeypatch):
    """A requeued SLURM job runs the same command: its default run folder must be the same, so it is
    named by the job id (every task of the job shares it too); elsewhere by the start time."""
    import re

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from vitexp import CONF_DIR
    from vitexp.config import composition as config

    for var in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(config, "_STAMP", [])
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d-[0-9a-f]{6}", config.run_stamp())
    monkeypatch.setattr(config, "_STAMP", [])
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    GlobalHydra.instance().clear()
    assert OmegaConf.select(cfg, "hydra.run.dir").endswith("/slurm-4242")


@pytest.mark.slow
def test_sigusr1_requeues_the_job_and_the_requeued_run_finishes_as_an_uninterrupted_one(tmp_path):
    """(About 2 minutes of CPU.) SIGUSR1 once the first epoch's checkpoint exists: ``scontrol requeue
    <job>`` is called, the entry closes interrupted (SIGUSR1, requeued); the same command again (what
    SLURM's requeue runs) reopens the same entry and ends with the metrics of an uninterrupted run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    whole_results, split_results = tmp_path / "whole_results", tmp_path / "split_results"
    whole = subprocess.run(
        _train(tmp_path / "whole"), env=cli_env(whole_results), capture_output=True, text=True, timeout=600
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = json.loads(whole.stdout.strip().splitlines()[-1])["metrics"]

    env = {
        **cli_env(split_results),
        "SLURM_JOB_ID": "4242",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    run_dir = tmp_path / "split"
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(
        _train(run_dir), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert ckpt.exists(), "the run ended before its first checkpoint"
    assert proc.returncode == 128 + signal.SIGUSR1, err[-3000:]
    assert calls.read_text().split() == ["requeue", "4242"]
    (stopped,) = ledger_entries(split_results)
    assert stopped["status"] == "interrupted" and stopped["signal"] == "SIGUSR1"
    assert stopped["requeued"] == "scontrol requeue 4242"

    again = subprocess.run(_train(run_dir), env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    (entry,) = ledger_entries(split_results)
    assert entry["run_id"] == stopped["run_id"] and entry["status"] == "completed"
    assert entry["attempts"][0]["status"] == "interrupted"
    for key in ("top1", "top5", "test_loss", "steps"):
        assert entry["metrics"][key] == pytest.approx(expected[key], rel=1e-6), key


@pytest.mark.slow
def test_two_rows_sweep_through_the_submitit_local_launcher(tmp_path):
    """(About 2 minutes of CPU.) ``vitexp-train -m ... hydra/launcher=submitit_local``: each job runs in a
    process of its own started by submitit, as on a cluster node, and writes its own completed entry."""
    results = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "vitexp.commands.cli",
        "train",
        "-m",
        *SMALL,
        "recipe.epochs=2",
        "seed=0,1",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
    ]
    done = subprocess.run(
        cmd, env=cli_env(results), capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    entries = ledger_entries(results)
    assert sorted(e["config"]["seed"] for e in entries) == [0, 1]
    assert all(e["status"] == "completed" for e in entries)
    assert len({e["env"]["pid"] for e in entries}) == 2 and os.getpid() not in {
        e["env"]["pid"] for e in entries
    }
    assert list((tmp_path / "multirun").glob(".submitit/*"))  # submitit's own job folders


def _submitit_handler(calls: list):
    """A stand-in for submitit's SIGUSR2 handler on rank 0 (``SignalHandler.checkpoint_and_try_requeue``:
    checkpoint, ``scontrol requeue``, then ``SystemExit(-1)``), named by submitit's module so that
    :func:`vitexp.runs.slurm.note_submitit_requeue` wraps it as it wraps the real one."""

    def checkpoint_and_try_requeue(signum, frame):
        calls.append(signum)
        raise SystemExit(-1)

    checkpoint_and_try_requeue.__module__ = "submitit.core.job_environment"
    return checkpoint_and_try_requeue


class _Stopped(Exception):
    """What this test's SIGTERM handler raises: the signal reached the handler from before the run."""


def _stop(signum, frame):
    raise _Stopped(signum)


def _signalled(real, *signums):
    """``real`` (a LedgerEntry method that closes the entry), preceded by ``signums`` sent to this
    process: SLURM's burst arriving while the entry is written."""

    def closing(self, *args, **kwargs):
        for signum in signums:
            os.kill(os.getpid(), signum)
        return real(self, *args, **kwargs)

    return closing


@pytest.fixture
def submitit_job(monkeypatch):
    """This process as a submitit job's rank 0 (``$SLURM_JOB_ID``, submitit's SIGUSR2 handler, a
    SIGTERM handler that raises :class:`_Stopped`); the handlers are restored after."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    calls: list = []
    installed = {signal.SIGUSR2: _submitit_handler(calls), signal.SIGTERM: _stop}
    previous = {s: signal.signal(s, h) for s, h in installed.items()}
    yield calls
    for s, h in previous.items():
        signal.signal(s, h)


def test_slurms_signals_while_an_interrupted_entry_closes_are_noted_never_raised(
    submitit_job, results_dir, tmp_path, monkeypatch
):
    """submitit's path: SIGUSR2, its handler requeues and exits; SLURM's SIGTERM (twice: slurmd's and srun's
    forwarded copy) and another SIGUSR1 and SIGUSR2 reach the process while vitexp closes the entry. They
    are noted, never raised: the entry closes ``interrupted`` by the first signal with submitit's requeue,
    submitit's handler ran once, and the process exits as after SIGUSR2 (128 + 12). (Seen to fail without
    the closing guard: the SIGTERM raised inside ``Run._fail`` left the entry ``running``.)"""
    from vitexp.ledger import LedgerEntry
    from vitexp.runs import slurm
    from vitexp.runs.owner import owned_run

    burst = (signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    monkeypatch.setattr(LedgerEntry, "interrupt", _signalled(LedgerEntry.interrupt, *burst))
    stopped = None
    try:
        with owned_run("demo", "train", results_dir, tmp_path / "run", resumable=True) as run:
            run.start(run_config(0))
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(5)  # (the signal's handler runs before this line)
    except BaseException as err:  # what ends the run, read after its entry
        stopped = err
    (entry,) = ledger_entries(results_dir)
    assert (entry["status"], entry.get("signal")) == ("interrupted", "SIGUSR2"), repr(stopped)
    assert entry["requeued"] == slurm.SUBMITIT_REQUEUE
    assert isinstance(stopped, SystemExit) and stopped.code == 128 + signal.SIGUSR2, repr(stopped)
    assert submitit_job == [signal.SIGUSR2]
    assert run.deferred == ["SIGTERM", "SIGTERM", "SIGUSR1", "SIGUSR2"]
    assert signal.getsignal(signal.SIGTERM) is _stop  # the handlers from before the run are back


def test_a_run_closing_completed_is_never_requeued_and_a_sigterm_then_ends_it(
    submitit_job, results_dir, tmp_path, monkeypatch
):
    """SIGUSR2 and SIGTERM while a completed run writes its entry: submitit's handler is not called (a
    completed run requeued would rerun a finished folder), the entry closes ``completed``, and the SIGTERM
    reaches the handler from before the run once the entry is closed."""
    from vitexp.ledger import LedgerEntry
    from vitexp.runs.owner import owned_run

    monkeypatch.setattr(LedgerEntry, "finish", _signalled(LedgerEntry.finish, signal.SIGUSR2, signal.SIGTERM))
    with pytest.raises(_Stopped):
        with owned_run("demo", "train", results_dir, tmp_path / "run", resumable=True) as run:
            run.start(run_config(0))
            run.complete({"top1": 50.0})
    assert submitit_job == [] and run.deferred == ["SIGUSR2", "SIGTERM"]
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed" and entry["metrics"] == {"top1": 50.0}
