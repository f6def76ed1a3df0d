"""Hydra conventions of the vitexp apps: the app's name, its help, the run folder named after the
run, the SLURM launcher config without the schema-matching warning, DDP inside a local multirun."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from conftest import TINY_TRAIN, cli_env

import vitexp.config.composition as vconfig


def vitexp_cli(*args: str, results_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vitexp.commands.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=cli_env(results_dir),
        timeout=300,
    )


def test_help_names_the_app_and_lists_the_groups(results_dir, tmp_path):
    proc = vitexp_cli("train", "--help", results_dir=results_dir, cwd=tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.startswith("vitexp: train, count or time") and "cli" not in proc.stdout.split("\n")[0]
    for group in ("backbone", "method", "budget", "recipe", "experiment"):
        assert f"{group}:" in proc.stdout, group


def test_the_run_folder_and_slurm_job_are_named_after_the_run():
    """Resolved as Hydra resolves them when a job starts (HydraConfig set, then the run dir read)."""
    from hydra.core.hydra_config import HydraConfig

    overrides = ["experiment=demo", "recipe.epochs=3", "hydra/launcher=slurm"]
    cfg = vconfig.compose(overrides, return_hydra_config=True)
    cfg.hydra.overrides.task = [o for o in overrides if not o.startswith("hydra")]
    HydraConfig.instance().set_config(cfg)
    try:
        assert cfg.hydra.run.dir.startswith("outputs/demo+recipe.epochs=3/")
        assert cfg.hydra.launcher.name == "demo+recipe.epochs=3"  # the SLURM job name
        assert cfg.hydra.job.name == "vitexp"  # the app's name: logs are vitexp.log
    finally:
        HydraConfig.instance().cfg = None


def test_slurm_launcher_composes_without_the_schema_matching_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = vconfig.compose(["hydra/launcher=slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher") and cfg.hydra.launcher.max_num_timeout >= 1


@pytest.mark.parametrize(
    "trainer",
    [["trainer=ddp_cpu"], pytest.param(["trainer=cpu", "trainer.devices=2"], marks=pytest.mark.slow)],
)
def test_subprocess_ddp_inside_a_local_multirun_is_refused(trainer, results_dir, tmp_path):
    """strategy=ddp, and strategy=auto with two devices (Lightning then picks the same subprocess DDP)."""
    proc = vitexp_cli(
        "train", "-m", *trainer, "logger=none", "seed=1,2", results_dir=results_dir, cwd=tmp_path
    )
    assert proc.returncode == 2
    assert "hydra/launcher=slurm" in proc.stderr and '"status": "invalid"' in proc.stdout.splitlines()[-1]


@pytest.mark.parametrize("app", ["train", "flops", "bench"])
@pytest.mark.parametrize("cfg_type", ["job", "hydra", "all"])
@pytest.mark.parametrize("resolve", [False, True])
def test_cfg_prints_the_config_of_every_app(app, cfg_type, resolve, monkeypatch, capsys):
    """``--cfg job|hydra|all [--resolve]``: Hydra prints the hydra node alone for ``--cfg hydra``,
    so its interpolations into the job config (the run name, the SLURM node count) must resolve
    without the job's keys."""
    from vitexp.commands import cli

    overrides = ["experiment=demo", "recipe.epochs=3", "hydra/launcher=slurm", "trainer.num_nodes=2"]
    monkeypatch.setattr(
        sys, "argv", [f"vitexp-{app}", "--cfg", cfg_type, *(["--resolve"] if resolve else []), *overrides]
    )
    getattr(cli, f"{app}_main")()
    printed = yaml.safe_load(capsys.readouterr().out)
    assert ("hydra" in printed) == (cfg_type != "job") and ("recipe" in printed) == (cfg_type != "hydra")
    if cfg_type != "hydra":
        assert printed["recipe"]["epochs"] == 3 and printed["name"] == "demo"
    if cfg_type != "job":
        run_dir, launcher = printed["hydra"]["run"]["dir"], printed["hydra"]["launcher"]
        if resolve:
            # two nodes are another configuration (the global batch): the name says so
            # (vitexp.ledger.fingerprint)
            assert (
                run_dir.startswith("outputs/demo+recipe.epochs=3,trainer.num_nodes=2/")
                and "${" not in run_dir
            )
            assert launcher["name"] == "demo+recipe.epochs=3,trainer.num_nodes=2" and launcher["nodes"] == 2
        else:
            assert "${vitexp_name:" in run_dir and "${" in str(launcher["nodes"])


@pytest.mark.parametrize(
    "buffering", [1, -1]
)  # line-buffered (fails in print), block-buffered (at the flush)
def test_a_reader_that_leaves_early_ends_the_app_quietly(buffering, monkeypatch):
    """``vitexp-train --help | head -3``: the pipe closes under the app; it exits 1, no traceback."""
    import os

    from vitexp.commands import cli

    read_end, write_end = os.pipe()
    os.close(read_end)
    monkeypatch.setattr(sys, "stdout", os.fdopen(write_end, "w", buffering=buffering))
    monkeypatch.setattr(sys, "argv", ["vitexp-train", "--help"])
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.train_main()
    finally:
        sys.stdout.close()
    assert exit_.value.code == 1


def test_the_device_count_lightning_will_use():
    """What the local-multirun DDP refusal counts: a list of ids by its length (devices=[0] is one),
    a count, "0,1", and auto/-1 as every visible GPU on a GPU accelerator (one process on the CPU)."""
    import torch
    from omegaconf import OmegaConf

    from vitexp.commands.cli import _device_count

    assert _device_count(OmegaConf.create({"d": [0]}).d, "gpu") == 1
    assert (
        _device_count([0, 1], "gpu") == 2
        and _device_count(2, "cpu") == 2
        and _device_count("0,1", "gpu") == 2
    )
    assert _device_count("auto", "cpu") == 1
    assert _device_count("auto", "gpu") == (torch.cuda.device_count() if torch.cuda.is_available() else 1)


def test_a_multirun_ends_with_one_summary_line(results_dir, tmp_path):
    """Two jobs, one failing: the other still runs, and the last line counts them by status with
    their run ids, as the ledger records them; exit 1. No Hydra 'Error executing job' line."""
    import json

    from conftest import ledger_entries

    proc = vitexp_cli(
        "train",
        "-m",
        *TINY_TRAIN[1:],  # without experiment=demo, the default
        "data.noise=nan,0.5",
        "logger=none",
        "trainer.enable_progress_bar=false",
        results_dir=results_dir,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    by_status = {e["status"]: e["run_id"] for e in ledger_entries(results_dir)}
    assert (
        summary["status"],
        summary["runs"],
        summary["completed"],
        summary["failed"],
        summary["interrupted"],
    ) == ("failed", 2, 1, 1, 0)
    assert summary["run_ids"] == {
        "completed": [by_status["completed"]],
        "failed": [by_status["failed"]],
        "interrupted": [],
    }
    assert not summary["multirun"].startswith(
        "/"
    )  # relative to the results root: no machine path in a closing line
    assert (results_dir / summary["multirun"]).resolve().parent == (tmp_path / "multirun").resolve()
    assert "Error executing job" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "trainer, asked",
    [
        (["trainer=cpu"], {"gpus_per_node": None, "tasks_per_node": 1, "cpus_per_task": 1, "mem_gb": 4}),
        (["trainer=ddp_cpu"], {"gpus_per_node": None, "tasks_per_node": 2, "cpus_per_task": 1, "mem_gb": 4}),
        (
            ["trainer=ddp", "trainer.devices=8"],
            {"gpus_per_node": 8, "tasks_per_node": 8, "cpus_per_task": 10, "mem_gb": 64},
        ),
        (
            ["trainer=ddp", "trainer.devices=8", "hydra.launcher.cpus_per_task=16"],
            {"gpus_per_node": 8, "tasks_per_node": 8, "cpus_per_task": 16, "mem_gb": 64},
        ),
    ],
)
def test_a_slurm_jobs_resources_follow_its_trainer(trainer, asked, monkeypatch, capsys):
    """The CPU demo asks no GPU (the guide's first sweep runs as written on a CPU partition); DDP on GPUs
    asks one task per GPU; a launcher override wins (vitexp.runs.slurm.resources)."""
    from vitexp.commands import cli

    monkeypatch.setattr(
        sys, "argv", ["vitexp-train", "--cfg", "hydra", "--resolve", "hydra/launcher=slurm", *trainer]
    )
    cli.train_main()
    launcher = yaml.safe_load(capsys.readouterr().out)["hydra"]["launcher"]
    assert {k: launcher[k] for k in asked} == asked


def test_gpu_ddp_under_slurm_needs_a_gpu_count():
    from omegaconf import OmegaConf

    from vitexp.errors import ConfigError
    from vitexp.runs.slurm import resources

    with pytest.raises(ConfigError, match=r"trainer.devices=auto .*trainer.devices=8"):
        resources(OmegaConf.create({"accelerator": "gpu", "devices": "auto", "strategy": "ddp"}))
