"""The SAPER audit's measures (vitexp/analysis/audit_saper.py): the Laplacian's spectrum with and
without symmetrisation, and the agreement between kept heads and head clusters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vitexp.analysis.audit_saper import agreement, kept_labels, laplacian_spectra, saper_record


def test_kept_heads_are_labelled_in_the_clusterings_layer_major_order():
    labels = kept_labels([[1], [0, 1], [1], []], heads_per_layer=4)
    assert np.flatnonzero(labels).tolist() == [1, 4, 5, 9]
    with pytest.raises(ValueError, match="outside 0..3"):
        kept_labels([[4]], heads_per_layer=4)


def test_a_selection_equal_to_one_of_two_clusters_agrees_fully():
    rng = np.random.default_rng(0)
    clusters = rng.permutation([0] * 6 + [1] * 10)
    result = agreement(clusters == 0, clusters, selections=2000)
    assert result["ami"] == pytest.approx(1.0, abs=1e-9)
    # 1 in C(16, 6) = 8008 random selections equals the cluster: p is near its floor 1/2001
    assert result["ami_p_value"] < 0.01
    shares = {c["cluster"]: c["kept_share"] for c in result["per_cluster"]}
    assert shares == {0: 1.0, 1: 0.0}
    assert result["per_cluster"][0]["chance_mean"] == pytest.approx(6 * 6 / 16, abs=0.1)


def test_random_selections_agree_about_zero_over_seeds():
    """AMI is adjusted for chance: over many random selections its mean is 0 within the standard
    error of that mean (4 standard errors: a 1-in-15,000 false alarm)."""
    rng = np.random.default_rng(1)
    clusters = rng.permutation([0] * 4 + [1] * 4 + [2] * 3 + [3] * 5)
    seeds = 200
    amis = []
    for seed in range(seeds):
        kept = np.zeros(16, dtype=int)
        kept[np.random.default_rng(100 + seed).choice(16, size=4, replace=False)] = 1
        amis.append(agreement(kept, clusters, selections=1, seed=seed)["ami"])
    amis = np.asarray(amis)
    tolerance = 4 * amis.std(ddof=1) / math.sqrt(seeds)
    assert abs(amis.mean()) <= tolerance
    chance = agreement(kept, clusters, selections=seeds)
    assert abs(chance["ami_chance_mean"]) <= 4 * chance["ami_chance_std"] / math.sqrt(seeds)


def test_the_laplacian_is_symmetric_psd_only_after_symmetrisation():
    """A directed 3-cycle whose first query attends mostly outside the patches (its row sums to 0.05)."""
    a = torch.tensor([[0.05, 0.9, 0.05], [0.05, 0.05, 0.9], [0.9, 0.05, 0.05]], dtype=torch.float64)
    a[0] *= 0.05
    spectra = laplacian_spectra(a)
    directed, symmetrised = spectra["directed"], spectra["symmetrised"]
    assert directed["complex_share"] == 1.0 and directed["imag_abs_max"] > 0.5
    assert directed["asymmetry_max"] > 1.0
    assert directed["quadratic_form_min"] < -1.0 and directed["not_psd_share"] == 1.0
    assert symmetrised["asymmetry_max"] < 1e-12 and symmetrised["imag_abs_max"] < 1e-12
    assert symmetrised["not_psd_share"] == 0.0
    assert -1e-12 < symmetrised["real_min"] and symmetrised["real_max"] <= 2.0


def test_a_missing_saper_run_names_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="vitexp-sweep saper_micro"):
        saper_record("run:saper_micro_ft_k4", tmp_path)


def test_the_audit_pins_the_teacher_the_saper_run_loaded_and_reports_each_finding(
    make_cfg, results_dir, tmp_path
):
    """A constructed ledger: two teacher runs (the second finished after the SAPER run started, so
    it is not the one SAPER pruned), a SAPER run with kept_heads; the audit loads the first teacher's
    weights, measures on the run's own test digits and renders (a), (b) and (c)."""
    import json

    from vitexp.analysis import audit_saper
    from vitexp.config.composition import to_container
    from vitexp.ledger import portable_paths
    from vitexp.models import build_backbone

    def record(run_id, experiment, cfg, started, finished, **extra):
        path = results_dir / "runs" / f"{run_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                portable_paths(  # as an entry stores its paths
                    {
                        "run_id": run_id,
                        "experiment": experiment,
                        "status": "completed",
                        "kind": "train",
                        "config": cfg,
                        "metrics": {"top1": 50.0},
                        "started": started,
                        "finished": finished,
                        **extra,
                    },
                    results_dir,
                )
            )
        )

    teacher_cfg = to_container(make_cfg(["experiment=saper_micro_teacher"]))
    for i, seed in enumerate((0, 1)):
        torch.manual_seed(seed)
        weights = tmp_path / f"teacher{i}.pth"
        torch.save(
            build_backbone({**teacher_cfg["backbone"], "pretrained": None}, num_classes=10).state_dict(),
            weights,
        )
        record(
            f"t{i}",
            "saper_micro_teacher",
            teacher_cfg,
            f"2026-01-0{1 + 2 * i}T00:00:00+00:00",
            f"2026-01-0{1 + 2 * i}T01:00:00+00:00",
            artifacts={"weights": str(weights)},
        )
    saper_cfg = to_container(make_cfg(["experiment=saper_micro", "name=saper_micro_ft_k4"]))
    record(
        "s0",
        "saper_micro_ft_k4",
        saper_cfg,
        "2026-01-02T00:00:00+00:00",
        "2026-01-02T01:00:00+00:00",
        kept_heads=[[1], [0, 1], [1], []],
    )
    findings = audit_saper.audit(
        ["run:saper_micro_ft_k4"], images=12, clusters=(2,), selections=50, results_dir=results_dir
    )
    (run,) = findings["runs"]
    assert (
        run["weights"] == "run:t0"
        and run["images"] == 12
        and (run["layers"], run["heads_per_layer"]) == (4, 4)
    )
    assert run["laplacian"]["graphs"] == 4 * 12 * 4 and run["laplacian"]["symmetrised"]["imag_abs_max"] == 0.0
    assert run["clusters"][2]["k"] == 4 and run["clusters"][2]["heads"] == 16
    report = audit_saper.render(findings)
    for heading in ("## (a)", "## (b)", "## (c)", "Not measured: no completed `vitexp-audit raptor` run"):
        assert heading in report
    metrics, protocol = audit_saper.summary(findings)
    assert protocol["saper_runs"] == {"s0": "run:t0"} and "saper_micro_ft_k4_c2_ami" in metrics
    given = str(
        tmp_path / "teacher1.pth"
    )  # --weights: e.g. a real DINOv2 checkpoint replaces the pinned teacher
    (run,) = audit_saper.audit(
        ["run:s0"], given, images=4, clusters=(2,), selections=10, results_dir=results_dir
    )["runs"]
    assert run["weights"] == given and run["laplacian"]["graphs"] == 4 * 4 * 4
