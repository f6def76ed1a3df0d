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
    with pytest.raises(FileNotFoundError, match="vitexp-train experiment=saper_micro_ft_k4"):
        saper_record("run:saper_micro_ft_k4", tmp_path)
