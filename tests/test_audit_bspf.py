"""The BSPF audit's measurements (vitexp/analysis/audit_bspf.py)."""

from __future__ import annotations

import pytest
import timm
import torch

import vitexp  # noqa: F401
from vitexp.analysis import audit_bspf
from vitexp.ledger import LedgerEntry


def _demo_run(results_dir, weights_dir, seed: int, started: str | None = None) -> str:
    """A completed ``demo`` train run in the ledger, its config the real demo's, its weights a
    micro ViT initialised with ``seed`` (a stand-in for training)."""
    from omegaconf import OmegaConf

    from vitexp.config.composition import compose

    torch.manual_seed(seed)
    weights = weights_dir / f"weights_{seed}.pth"
    torch.save(timm.create_model("vit_micro_patch4_32", num_classes=10).state_dict(), weights)
    cfg = compose(["experiment=demo"])
    config = {
        k: OmegaConf.to_container(cfg[k], resolve=True)
        for k in ("backbone", "method", "data", "recipe", "budget", "trainer")
    }
    entry = LedgerEntry("demo", "train", {**config, "name": "demo"}, results_dir).start()
    if started:
        entry.record["started"] = started
    entry.finish({"top1": 90.0}, artifacts={"weights": str(weights)})
    return entry.run_id


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


def test_audit_is_reproducible_from_the_runs_it_pins(results_dir, tmp_path):
    old = _demo_run(results_dir, tmp_path, seed=0, started="2000-01-01T00:00:00+00:00")
    first = audit_bspf.micro_findings("run:demo", images=2, results_dir=results_dir)
    assert first["pinned"]["run_id"] == old and first["pinned"]["weights"].endswith("weights_0.pth")
    assert audit_bspf.micro_findings(f"run:{old}", images=2, results_dir=results_dir) == first
    # a newer demo run is what run:demo now pins; the old run id still reproduces the old numbers
    new = _demo_run(results_dir, tmp_path, seed=1)  # started now: the newest
    newer = audit_bspf.micro_findings("run:demo", images=2, results_dir=results_dir)
    assert newer["pinned"]["run_id"] == new and newer["attn_asym_max"] != first["attn_asym_max"]
    assert audit_bspf.micro_findings(f"run:{old}", images=2, results_dir=results_dir) == first


def test_the_pinned_weights_load_from_the_portable_path_the_ledger_keeps(results_dir, tmp_path, monkeypatch):
    """Weights inside the results folder are stored relative to it: loaded from any working folder."""
    (results_dir / "outputs").mkdir(parents=True)
    _demo_run(results_dir, results_dir / "outputs", seed=0)
    monkeypatch.chdir(tmp_path)
    pinned = audit_bspf.micro_findings("run:demo", images=2, results_dir=results_dir)["pinned"]
    assert pinned["weights"] == "outputs/weights_0.pth"


def test_audit_without_a_pinned_run_names_what_to_train(results_dir):
    with pytest.raises(FileNotFoundError, match="vitexp-train experiment=demo"):
        audit_bspf.micro_findings("run:demo", images=2, results_dir=results_dir)


def test_report_separates_what_was_measured_from_what_is_true_by_construction(results_dir, tmp_path):
    run_id = _demo_run(results_dir, tmp_path, seed=0)
    micro = audit_bspf.micro_findings("run:demo", images=2, results_dir=results_dir)
    findings = {
        "micro": micro,
        "deit_small": micro,
        "deit_small_weights": audit_bspf.RANDOM_DEIT,
        "images": {"micro": 4, "deit_small": 2},
        "prune_layers": [4, 6, 9],
        "scoring_cost": audit_bspf.scoring_cost_per_layer(196, 1, 384, 49, [4, 6, 9], 12, 0.5),
        "gmacs": {"deit_small": 4.599, "chunk": 4.333, "bspf": 2.391},
        "top1": {"deit_small": None, "chunk": None, "bspf": None},
        "top1_runs": {"deit_small": None, "chunk": None, "bspf": None},
    }
    report = audit_bspf.render(findings)
    sections = dict(part.split("\n", 1) for part in report.split("## (")[1:])
    a, b, c, d = (next(v for k, v in sections.items() if k.startswith(x)) for x in "abcd")
    assert run_id in report.split("## (")[0]
    assert "Measured" in a and "DeiT-S at random initialisation" in a and "untrained DeiT-S" in report
    assert (
        "True by construction" in b
        and "complement of the same mask" in b
        and "by construction" in b.split("Verdict")[1]
    )
    assert "Counted" in c
    assert "GMACs" in d.split("\n\n")[0] and "Verdict on FLOPs" in d and "accuracy not run" in d
    metrics, protocol = audit_bspf.summary(findings)
    assert protocol["micro_run"] == run_id and all(isinstance(v, (int, float)) for v in metrics.values())


@pytest.mark.slow
def test_audit_cli_writes_report_and_ledger(results_dir, tmp_path):
    from vitexp.commands.cli import audit_main

    _demo_run(results_dir, tmp_path, seed=0)
    audit_main(["bspf", "--images", "4", "--results-dir", str(results_dir)])
    report = (results_dir / "audit" / "bspf.md").read_text()
    for section in ("(a)", "(b)", "(c)", "(d)"):
        assert f"## {section}" in report
    assert "not run" in report
