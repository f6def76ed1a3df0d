"""The BSPF audit's measurements (vitexp/analysis/audit_bspf.py)."""
from __future__ import annotations

import pytest
import timm
import torch

import vitexp  # noqa: F401
from vitexp.analysis import audit_bspf


def test_symmetry_and_literal_fusion_findings_on_real_digits():
    torch.manual_seed(0)
    model = timm.create_model("vit_micro_patch4_32", num_classes=10).eval()
    f = audit_bspf.symmetry_findings(model, audit_bspf._digits(32, 8), chunk_size=16, layers=[1, 3])
    assert f["attn_asym_max"] > 0  # row softmax: A != A^T even with W_q = W_k
    assert 0 <= f["mirror_decisions_differ"] <= 1 and f["mirror_decisions_total"] == 8 * 4 * 16 + 8 * 4 * 8
    assert f["paper_literal_vs_none_max_diff"] == 0.0
    assert f["conv_asym_random_kernel"] > 1e-3 and f["conv_asym_symmetrised_kernel"] < 1e-5


def test_scoring_cost_is_quadratic_for_all_blocks():
    rows = audit_bspf.scoring_cost_per_layer(196, 1, 384, 49, [4, 6, 9], 12, 0.5)
    first = rows[0]
    assert first["all_blocks_gmacs"] * 1e9 == 196 * 196 * (384 + 9)
    assert first["diagonal_gmacs"] * 1e9 == 4 * 49 * 49 * (384 + 9)
    assert first["ratio"] == pytest.approx(4.0)
    assert [r["chunk_size"] for r in rows] == [49] * 5 + [25] * 2 + [13] * 3 + [7] * 2


@pytest.mark.slow
def test_audit_cli_writes_report_and_ledger(results_dir):
    from vitexp.cli import audit_main

    audit_main(["bspf", "--images", "4", "--results-dir", str(results_dir)])
    report = (results_dir / "audit" / "bspf.md").read_text()
    for section in ("(a)", "(b)", "(c)", "(d)"):
        assert f"## {section}" in report
    assert "not run" in report

