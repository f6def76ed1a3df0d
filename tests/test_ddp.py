"""trainer=ddp_cpu: the DDP code path (2 processes, gloo) on the CPU, metrics synced."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import cli_env, ledger_entries


def test_ddp_cpu_two_processes_one_ledger_entry(results_dir, tmp_path):
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "vitexp-train"), "trainer=ddp_cpu", "data=synthetic",
         "recipe.epochs=2", "recipe.warmup_epochs=0", "logger=none", "trainer.enable_progress_bar=false",
         "eval.throughput_iters=2", f"hydra.run.dir={tmp_path / 'out'}"],
        capture_output=True, text=True, cwd=tmp_path, env=cli_env(results_dir), timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, "only rank 0 prints the closing line"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed" and entry["metrics"]["world_size"] == 2
    assert result["metrics"]["top1"] == entry["metrics"]["top1"]
    # 512 training images, batch 64, 2 ranks: 4 steps per epoch per rank
    assert entry["metrics"]["steps"] == 8
    assert "Initializing distributed: GLOBAL_RANK: 1" in proc.stderr + proc.stdout


def test_raptor_stages_run_under_ddp_cpu(results_dir, tmp_path):
    """Several fits in one DDP job (RAPTOR's stages and probes): one process group, one ledger entry."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "vitexp-train"), "trainer=ddp_cpu", "backbone=dinov2_micro", "method=raptor",
         "budget=blocks", "recipe=raptor", "data=synthetic", "recipe.epochs=1", "recipe.warmup_steps=2",
         "method.probe.epochs=1", "method.probe.batch_size=64", "method.phase_images=32", "logger=none",
         "trainer.enable_progress_bar=false", "eval.throughput_iters=2", f"hydra.run.dir={tmp_path / 'out'}"],
        capture_output=True, text=True, cwd=tmp_path, env=cli_env(results_dir), timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (entry,) = ledger_entries(results_dir)
    m = entry["metrics"]
    assert entry["status"] == "completed" and m["world_size"] == 2
    assert {"stage1_val_loss", "stage2_val_loss", "top1", "teacher_top1", "recovered"} <= set(m)
    # 512 images, batch 64, 2 ranks: 4 steps per rank in each of the four one-epoch stages
    assert m["steps"] == 16
