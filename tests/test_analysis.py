"""SAPER's interpretability analyses on the micro DINOv2 with digits (vitexp/analysis/heads.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from conftest import ledger_entries

import vitexp  # noqa: F401
from vitexp.analysis.heads import (
    attention_maps,
    cluster_heads,
    davies_bouldin_precomputed,
    laplace_rgb,
    normalized_laplacian,
)


def test_attention_maps_reproduce_timms_attention_output():
    """maps @ V through the projection is what each block's timm Attention outputs (float64,
    LayerScale 1 so every block sees a different input); rows are probabilities."""
    torch.manual_seed(0)
    model = timm.create_model("vit_micro_patch14_dinov2", init_values=1.0).double().eval()
    seen = []
    hooks = [
        b.attn.register_forward_hook(lambda m, args, out: seen.append((args[0], out))) for b in model.blocks
    ]
    x = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    model.forward_features(x)
    for h in hooks:
        h.remove()
    maps = attention_maps(model, x)
    assert maps.shape == (4, 2, 4, 17, 17)
    torch.testing.assert_close(maps.sum(-1), torch.ones(4, 2, 4, 17, dtype=torch.float64))
    for block, a, (inp, out) in zip(model.blocks, maps, seen[:4]):
        attn = block.attn
        v = attn.qkv(inp).reshape(2, 17, 3, 4, 16)[:, :, 2].transpose(1, 2)  # B, heads, N, d
        torch.testing.assert_close(
            attn.proj((a @ v).transpose(1, 2).reshape(2, 17, 64)), out, rtol=1e-10, atol=1e-10
        )


def test_symmetrised_normalised_laplacian_is_psd_and_has_a_zero_eigenvalue():
    a = torch.rand(16, 16).softmax(-1)  # a directed (row-stochastic) attention graph
    lap = normalized_laplacian(a.double())
    torch.testing.assert_close(lap, lap.T)
    eig = torch.linalg.eigvalsh(lap)
    assert eig.min() > -1e-9 and abs(float(eig[0])) < 1e-9
    rgb = laplace_rgb(a, 4)
    assert rgb.shape == (4, 4, 3) and rgb.min() >= 0 and rgb.max() <= 1


def test_laplace_maps_do_not_depend_on_the_eigensolvers_signs(monkeypatch):
    """eigh may return v or −v; the map is the same (largest-magnitude entry made positive)."""
    a = torch.rand(16, 16, generator=torch.Generator().manual_seed(0)).softmax(-1)
    reference = laplace_rgb(a, 4)
    eigh = torch.linalg.eigh

    def flipped(matrix):
        values, vectors = eigh(matrix)
        return values, vectors * torch.tensor([1.0, -1.0, 1.0, -1.0] * 4, dtype=vectors.dtype)

    monkeypatch.setattr(torch.linalg, "eigh", flipped)
    np.testing.assert_allclose(laplace_rgb(a, 4), reference, atol=1e-6)


def test_davies_bouldin_from_precomputed_distances_uses_medoids():
    # clusters {0, 1, 2} (medoid 1: summed distance 2) and {3, 4} (medoid 3, the first of a tie)
    d = np.array(
        [[0, 1, 2, 9, 9], [1, 0, 1, 8, 9], [2, 1, 0, 7, 9], [9, 8, 7, 0, 2], [9, 9, 9, 2, 0]], dtype=float
    )
    labels = np.array([0, 0, 0, 1, 1])
    s0, s1 = (1 + 0 + 1) / 3, (0 + 2) / 2
    assert davies_bouldin_precomputed(d, labels) == pytest.approx((s0 + s1) / 8)


def test_cluster_scores_use_the_correlation_distance_the_clustering_used():
    """Heads that are scaled copies of 3 signals (scales 1e-2 .. 1e2) are perfectly correlated
    within a group: with D = (1 − ρ)/2 the clusters are tight (silhouette ≈ 1, Davies–Bouldin ≈ 0);
    Euclidean distances on the raw values would call them poor."""
    rng = np.random.default_rng(0)
    signals = rng.normal(size=(200, 3))
    scales = [1e-2, 1.0, 1e2]
    heads = [
        scale * signals[:, c] + offset for c in range(3) for scale, offset in zip(scales, (0.0, 5.0, -3.0))
    ]
    values = np.stack(heads, 1) + 1e-6 * rng.normal(size=(200, 9))
    result = cluster_heads(values, 3)
    labels = result["labels"]
    assert len(set(labels[[0, 1, 2]])) == len(set(labels[[3, 4, 5]])) == len(set(labels[[6, 7, 8]])) == 1
    assert len(set(labels)) == 3
    assert result["silhouette"] > 0.99 and result["davies_bouldin"] < 0.01


@pytest.mark.parametrize(
    "analysis, extra", [("laplace", []), ("clusters", ["--images", "64", "--clusters", "3"])]
)
def test_analyze_cli_on_micro_dinov2_and_digits(analysis, extra, results_dir, capsys):
    from vitexp.commands.cli import analyze_main
    from vitexp.ledger import local_path

    analyze_main([analysis, "backbone=dinov2_micro", "logger=none", *extra])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "completed"
    (entry,) = ledger_entries(results_dir)
    assert entry["kind"] == "analyze" and entry["status"] == "completed"
    figure = local_path(entry["figure"], results_dir)  # stored relative to the results folder
    assert not Path(entry["figure"]).is_absolute() and Path(out["figure"]) == figure
    assert open(figure, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # the figures' folder (committed) holds figures; the run's lock and files are in analysis/run/<name>
    assert {p.name for p in (results_dir / "analysis").iterdir()} == {figure.name, "run"}
    assert (results_dir / "analysis" / "run" / entry["experiment"] / "run.lock").is_file()
    if analysis == "clusters":
        assert -1 <= entry["metrics"]["silhouette"] <= 1 and entry["metrics"]["davies_bouldin"] >= 0
        assert len(entry["head_clusters"]) == 16
    else:
        assert entry["metrics"]["min_laplacian_eigenvalue"] > -1e-6
