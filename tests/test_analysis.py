"""SAPER's interpretability analyses on the micro DINOv2 with digits (vitexp/analysis/heads.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch

import vitexp  # noqa: F401
from vitexp.analysis.heads import attention_maps, laplace_rgb, normalized_laplacian

from conftest import ledger_entries


def test_attention_maps_match_timm_attention_and_rows_sum_to_one():
    torch.manual_seed(0)
    model = timm.create_model("vit_micro_patch14_dinov2").eval()
    maps = attention_maps(model, torch.randn(2, 3, 56, 56))
    assert maps.shape == (4, 2, 4, 17, 17)
    torch.testing.assert_close(maps.sum(-1), torch.ones(4, 2, 4, 17))


def test_symmetrised_normalised_laplacian_is_psd_and_has_a_zero_eigenvalue():
    a = torch.rand(16, 16).softmax(-1)  # a directed (row-stochastic) attention graph
    lap = normalized_laplacian(a.double())
    torch.testing.assert_close(lap, lap.T)
    eig = torch.linalg.eigvalsh(lap)
    assert eig.min() > -1e-9 and abs(float(eig[0])) < 1e-9
    rgb = laplace_rgb(a, 4)
    assert rgb.shape == (4, 4, 3) and rgb.min() >= 0 and rgb.max() <= 1


@pytest.mark.parametrize("analysis, extra", [("laplace", []), ("clusters", ["--images", "64", "--clusters", "3"])])
def test_analyze_cli_on_micro_dinov2_and_digits(analysis, extra, results_dir, capsys):
    from vitexp.cli import analyze_main
    from vitexp.results import local_path

    analyze_main([analysis, "backbone=dinov2_micro", "logger=none", *extra])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "completed"
    (entry,) = ledger_entries(results_dir)
    assert entry["kind"] == "analyze" and entry["status"] == "completed"
    figure = local_path(entry["figure"], results_dir)  # stored relative to the results folder
    assert not Path(entry["figure"]).is_absolute() and Path(out["figure"]) == figure
    assert open(figure, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    if analysis == "clusters":
        assert -1 <= entry["metrics"]["silhouette"] <= 1 and entry["metrics"]["davies_bouldin"] >= 0
        assert len(entry["head_clusters"]) == 16
    else:
        assert entry["metrics"]["min_laplacian_eigenvalue"] > -1e-6
