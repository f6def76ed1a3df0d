"""``vitexp-analyze heads``: a SAPER run's kept heads and scores beside the head clusters
(vitexp/analysis/head_grid.py, vitexp/analysis/reports.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import QUIET, ledger_entries

import vitexp  # noqa: F401
from vitexp.analysis.head_grid import checkpoint_scores, draw_head_grid, kept_mask


def test_the_grid_outlines_exactly_the_kept_heads(tmp_path):
    kept = [[0, 2], [], [1]]
    scores = torch.tensor([0.9, -0.1, 0.8, 0.0, 0.1, -0.2, 0.3, 0.7, 0.2])
    marked = draw_head_grid(kept, 3, scores, [0, 0, 1, 1, 2, 2, 0, 1, 2], tmp_path / "heads.png", "t")
    expected = [(0, 0), (0, 2), (2, 1)]
    assert marked == {"scores": expected, "clusters": expected}
    assert (tmp_path / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw_head_grid(kept, 3, None, None, tmp_path / "bare.png", "t") == {"scores": expected}


def test_kept_heads_outside_the_layer_are_refused():
    with pytest.raises(ValueError, match="outside 0..3"):
        kept_mask([[0, 4]], 4)


#: A SAPER run on the micro DINOv2 (16 heads) in seconds: 5 heads kept, scores in its checkpoint.
TINY_SAPER = [
    "backbone=dinov2_micro",
    "+backbone.kwargs.init_values=1.0",
    "method=saper_ft",
    "budget=heads",
    "budget.k=5",
    "data=synthetic",
    "data.num_train=64",
    "data.num_val=32",
    "data.num_test=32",
    "recipe.batch_size=32",
    "recipe.epochs=1",
    "recipe.warmup_epochs=0",
    "recipe.lr=0.05",
    "eval.throughput_iters=1",
    "eval.throughput_batch=8",
    "trainer.num_sanity_val_steps=0",
]


def test_analyze_heads_draws_the_runs_kept_heads_and_scores(make_cfg, results_dir, tmp_path, capsys):
    from vitexp.commands.cli import analyze_main
    from vitexp.commands.train import train
    from vitexp.ledger import local_path

    train(make_cfg(QUIET + TINY_SAPER, tmp_path / "saper"))
    (run,) = ledger_entries(results_dir)
    kept = run["kept_heads"]
    capsys.readouterr()
    analyze_main(["heads", "--run", run["run_id"], "logger=none", "--images", "32", "--clusters", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "completed"
    entry = [e for e in ledger_entries(results_dir) if e["kind"] == "analyze"][0]
    expected = sorted((layer, head) for layer, heads in enumerate(kept) for head in heads)
    assert len(expected) == 5
    assert [tuple(c) for c in entry["marked"]["scores"]] == expected
    assert [tuple(c) for c in entry["marked"]["clusters"]] == expected
    assert entry["analyzes"] == run["run_id"] and entry["scores_agree_with_kept"] is True
    scores = checkpoint_scores(tmp_path / "saper" / "checkpoints" / "select" / "last.ckpt")
    assert scores is not None and entry["head_scores"] == pytest.approx(scores.tolist(), abs=1e-6)
    assert len(entry["head_clusters"]) == 16 and len(entry["figures"]) == 2
    for figure in entry["figures"]:
        assert local_path(figure, results_dir).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analyze_heads_refuses_a_run_that_is_not_saper(make_cfg, results_dir, tmp_path, capsys):
    from vitexp.commands.cli import analyze_main
    from vitexp.commands.train import train

    train(
        make_cfg(
            QUIET
            + [
                "backbone=dinov2_micro",
                "data=synthetic",
                "data.num_train=32",
                "data.num_val=32",
                "data.num_test=32",
                "recipe.epochs=1",
                "recipe.warmup_epochs=0",
                "eval.throughput_iters=1",
                "eval.throughput_batch=8",
                "trainer.num_sanity_val_steps=0",
            ],
            tmp_path / "base",
        )
    )
    (run,) = ledger_entries(results_dir)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        analyze_main(["heads", "--run", run["run_id"], "logger=none"])
    assert exit_info.value.code == 2
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "invalid" and "not a completed SAPER train run" in out["error"]
    assert [e["kind"] for e in ledger_entries(results_dir)] == ["train"]  # no analyze entry written
