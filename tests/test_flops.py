"""The MAC counter against an analytic ViT formula and the published DeiT figures."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import vit_analytic_macs

import vitexp  # noqa: F401
from vitexp.measure.flops import count_macs


@pytest.mark.parametrize(
    "name, img, patch, dim, depth, classes",
    [
        ("vit_micro_patch4_32", 32, 4, 64, 6, 10),
        ("deit_tiny_patch16_224", 224, 16, 192, 12, 1000),
        ("deit_small_patch16_224", 224, 16, 384, 12, 1000),
    ],
)
def test_counter_equals_analytic_vit_formula(name, img, patch, dim, depth, classes):
    model = timm.create_model(name, num_classes=classes)
    counted = count_macs(model, img)
    analytic = vit_analytic_macs(
        img_size=img, patch_size=patch, embed_dim=dim, depth=depth, mlp_ratio=4.0, num_classes=classes
    )
    assert counted.gmacs * 1e9 == pytest.approx(analytic, rel=1e-9)
    assert counted.gflops == pytest.approx(2 * counted.gmacs)


@pytest.mark.parametrize(
    "name, published", [("deit_tiny_patch16_224", 1.26), ("deit_small_patch16_224", 4.61)]
)
def test_published_deit_gmacs(name, published):
    report = count_macs(timm.create_model(name), 224)
    assert report.gmacs == pytest.approx(published, abs=0.02)
    assert report.protocol["attention_counted"] and report.protocol["resolution"] == 224
    assert report.protocol["unit"].startswith("GMACs")


def test_attention_is_counted_through_sdpa():
    """Without the SDPA handle DeiT-S comes out at 4.25 GMACs: the 12 layers' attention
    matmuls (2·N²·D each, N=197, D=384) are the difference."""
    report = count_macs(timm.create_model("deit_small_patch16_224"), 224)
    attention = 12 * 2 * 197 * 197 * 384
    assert report.gmacs * 1e9 - attention == pytest.approx(4.2409e9, rel=1e-3)


class _Attn(nn.Module):
    def forward(self, x):
        q = k = v = x
        return F.scaled_dot_product_attention(q, k, v)


def test_sdpa_handle_counts_qk_and_av():
    macs = count_macs(_WrapConvIn(_Attn(), (2, 3, 7, 5)), img_size=4, in_chans=1).gmacs * 1e9  # B, H, N, d
    assert macs == 2 * 3 * 7 * 7 * (5 + 5)


class _WrapConvIn(nn.Module):
    """Ignores the image and feeds a fixed-shape tensor to ``inner`` (to count one op alone)."""

    def __init__(self, inner, shape):
        super().__init__()
        self.inner, self.shape = inner, shape
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, img):
        return self.inner(torch.zeros(self.shape) + self.dummy)


def test_normalisation_and_elementwise_ops_are_not_counted():
    model = nn.Sequential(nn.LayerNorm(8), nn.GELU(), nn.Softmax(dim=-1))
    macs = count_macs(_WrapConvIn(model, (1, 4, 8)), img_size=4, in_chans=1).gmacs
    assert macs == 0.0
    linear = count_macs(_WrapConvIn(nn.Linear(8, 3), (1, 4, 8)), img_size=4, in_chans=1).gmacs * 1e9
    assert linear == 4 * 8 * 3


def test_flops_of_a_saper_model_count_the_same_heads_whatever_the_global_rng(tmp_path):
    """SAPER's initial head scores pick the k heads of the counted model: vitexp-flops seeds by
    ``cfg.seed`` before building, so two runs count (and record) the same model. Here k = 3 of 16
    heads leaves some layers headless, whose params differ by which layers those are."""
    import json

    from vitexp.commands.inspect import run_flops
    from vitexp.config.composition import compose
    from vitexp.ledger.paths import local_path

    def once(global_seed: int):
        cfg = compose(
            [
                "backbone=dinov2_micro",
                "method=saper_ft",
                "budget=heads",
                "budget.k=3",
                "data=digits",
                "logger=none",
                f"results_dir={tmp_path}",
                f"output_dir={tmp_path}/out{global_seed}",
            ]
        )
        torch.manual_seed(global_seed)
        result = run_flops(cfg)
        return result["metrics"], json.loads(local_path(result["ledger"], tmp_path).read_text())["kept_heads"]

    (m1, heads1), (m2, heads2) = once(1), once(2)
    assert sum(len(h) for h in heads1) == 3
    assert heads1 == heads2 and m1 == m2
