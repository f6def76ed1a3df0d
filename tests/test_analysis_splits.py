"""vitexp-analyze splits: two runs' per-image correctness on the validation and test splits, the paired
difference, McNemar's counts and the paired bootstrap over images (vitexp/analysis/splits.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import QUIET, ledger_entries

#: The digits demo, three epochs: a real run with 359 validation and 360 test images, not yet accurate,
#: so two seeds disagree on many images.
DEMO = QUIET + ["recipe.epochs=3", "recipe.warmup_epochs=0", "eval.throughput=false", "eval.flops=false"]


def analyze(capsys, *argv: str) -> dict:
    from vitexp.commands.cli import analyze_main

    capsys.readouterr()
    analyze_main(["splits", *argv])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_run_against_itself_differs_by_nothing(results_dir, capsys, trained_run):
    run = trained_run(DEMO + ["name=split_a"], "a")
    result = analyze(capsys, "--runs", run["run_id"], "split_a", "--boot", "200", "logger=none")
    report = json.loads(open(result["report"]).read())
    for split, key in (("val", "val_top1"), ("test", "top1")):
        row = report[split]
        assert (
            row["diff"] == 0
            and row["only_a"] == row["only_b"] == 0
            and row["se"] == 0
            and row["ci95"] == [0, 0]
        )
        assert row["top1_a"] == pytest.approx(run["metrics"][key], abs=1e-4)
    assert report["gap"] == {"diff": 0, "se": 0, "z": None}
    assert sorted(e["kind"] for e in ledger_entries(results_dir)) == ["analyze", "train"]


def test_two_runs_accuracies_are_the_ledgers_and_the_bootstrap_is_paired(
    results_dir, tmp_path, capsys, trained_run
):
    """Each model's accuracy on each split is its ledger value; b - c over the split is the difference;
    the bootstrap's standard error is the paired one, 100 sqrt(b + c - (b - c)^2 / n) / n in closed form
    (2,000 replicates: about 1.6 % relative error, 6 % allowed), not the unpaired one of two accuracies."""
    a = trained_run(DEMO + ["name=split_a"], "a")
    b = trained_run(DEMO + ["name=split_b", "seed=7"], "b")
    out = tmp_path / "report.json"
    result = analyze(capsys, "--runs", a["run_id"], b["run_id"], "--out", str(out), "logger=none")
    assert result["status"] == "completed" and result["report"] == str(out)
    report = json.loads(out.read_text())
    assert report["runs"] == {"a": a["run_id"], "b": b["run_id"]}
    assert (report["val"]["images"], report["test"]["images"]) == (
        359,
        360,
    )  # the digits split of 1,797 images
    disagreements = 0
    for split, key in (("val", "val_top1"), ("test", "top1")):
        row, n = report[split], report[split]["images"]
        assert row["top1_a"] == pytest.approx(a["metrics"][key], abs=1e-4)
        assert row["top1_b"] == pytest.approx(b["metrics"][key], abs=1e-4)
        assert row["ledger_top1_a"] == a["metrics"][key] and row["ledger_top1_b"] == b["metrics"][key]
        assert row["diff"] == pytest.approx(100.0 * (row["only_a"] - row["only_b"]) / n, abs=1e-9)
        assert row["only_a"] + row["only_b"] + row["both"] + row["neither"] == n
        bc = row["only_a"] + row["only_b"]
        disagreements += bc
        paired = 100.0 * np.sqrt((bc - (row["only_a"] - row["only_b"]) ** 2 / n) / n) / np.sqrt(n)
        assert row["se"] == pytest.approx(paired, rel=0.06)
        assert row["ci95"][0] < row["diff"] < row["ci95"][1]
    assert disagreements > 0  # two seeds that agree everywhere would test nothing
    gap = report["gap"]
    assert gap["diff"] == pytest.approx(report["test"]["diff"] - report["val"]["diff"])
    assert gap["se"] == pytest.approx(np.hypot(report["test"]["se"], report["val"]["se"]))
    assert gap["z"] == pytest.approx(gap["diff"] / gap["se"])
    assert "does not include seed variation" in report["method"]
    classes = report["by_class"]  # per label: its images of each split, weighted back to the split's numbers
    assert [c["label"] for c in classes] == list(range(10))
    for split in ("val", "test"):
        n = report[split]["images"]
        assert sum(c[split]["images"] for c in classes) == n
        assert sum(c[split]["images"] * c[split]["top1_a"] for c in classes) / n == pytest.approx(
            report[split]["top1_a"]
        )
        assert sum(c[split]["images"] * c[split]["diff"] for c in classes) / n == pytest.approx(
            report[split]["diff"]
        )
    assert all(c["gap"]["diff"] == pytest.approx(c["test"]["diff"] - c["val"]["diff"]) for c in classes)
    for c in classes:  # a confusion-matrix row per model: its diagonal is the label's correct images
        for split in ("val", "test"):
            row = c[split]
            for side in "ab":
                counts = row[f"predicted_{side}"]
                assert len(counts) == 10 and sum(counts) == row["images"]
                assert counts[c["label"]] == round(row["images"] * row[f"top1_{side}"] / 100)
    assert any(c[s]["predicted_a"][c["label"]] < c[s]["images"] for c in classes for s in ("val", "test"))
    entry = next(e for e in ledger_entries(results_dir) if e["kind"] == "analyze")
    assert entry["status"] == "completed" and entry["analyzes"] == [a["run_id"], b["run_id"]]
    again = analyze(
        capsys, "--runs", a["run_id"], b["run_id"], "--out", str(tmp_path / "again.json"), "logger=none"
    )
    assert json.loads(open(again["report"]).read()) == report  # --seed fixes the bootstrap


def test_runs_on_different_data_are_refused_before_anything_is_written(results_dir, capsys, trained_run):
    a = trained_run(DEMO + ["name=split_a"], "a")
    other = trained_run(DEMO + ["name=split_other", "data.split_seed=1"], "other")
    with pytest.raises(SystemExit) as exit_:
        analyze(capsys, "--runs", a["run_id"], other["run_id"], "logger=none")
    assert exit_.value.code == 2
    assert "data.split_seed" in capsys.readouterr().err
    assert sorted(e["kind"] for e in ledger_entries(results_dir)) == ["train", "train"]


def _script(name: str):
    import importlib.util

    from vitexp import PROJECT_ROOT

    spec = importlib.util.spec_from_file_location(name, PROJECT_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_closeness_counts_the_grid14_tokens_a_garment_covers():
    """scripts/split_closeness.py: a token of the 14 x 14 grid is 2 x 2 original pixels; it counts
    when any of them is non-zero."""
    import torch

    module = _script("split_closeness")
    images = torch.zeros(2, 28, 28, dtype=torch.uint8)
    images[0, 0, 0] = images[0, 1, 1] = 3  # one token
    images[0, 27, 26] = 1  # another (row 13, column 13)
    images[1, 2:6, 2:4] = 255  # 2 x 1 tokens
    assert module.foreground_tokens(images).tolist() == [2, 2]
    assert module.foreground_tokens(torch.full((1, 28, 28), 9, dtype=torch.uint8)).tolist() == [196]


def test_seed_scatter_compares_each_cells_splits_and_leaves_out_what_the_verdicts_do():
    """scripts/seed_scatter.py: sd_val / sd_test per counted cell, and P(F >= ratio^2 / (n_test / n_val))
    under F(n - 1, n - 1); with 5 pairs F(4, 4)'s survival function is the regularised incomplete beta
    I_z(2, 2) = 3z^2 - 2z^3 at z = 1 / (1 + f)."""
    module = _script("seed_scatter")

    def cell(protocol, n, sd_test, sd_val, reference=False, val_n=None):
        return {
            "protocol": protocol,
            "sign": "undecided",
            "n": n,
            "std": sd_test,
            "reference": reference,
            "val": {"n": val_n or n, "std": sd_val},
        }

    claims = [
        {
            "claim": "a beats b",
            "cells": [
                cell("p1", 5, 0.1, 0.45),
                cell("p2", 5, 0.3, 0.3),
                cell("ref", 5, 0.1, 0.9, reference=True),
                cell("short", 2, 0.1, 0.9),
                cell("uneven", 5, 0.1, 0.9, val_n=4),
                {"protocol": "p3", "sign": None, "text": "not in this protocol"},
            ],
        }
    ]
    report = module.scatter(claims, image_ratio=2.0)
    assert [c["protocol"] for c in report["cells"]] == ["p1", "p2"]
    first, second = report["cells"]
    assert first["ratio"] == pytest.approx(4.5) and second["ratio"] == pytest.approx(1.0)
    for c in report["cells"]:
        z = 1.0 / (1.0 + c["ratio"] ** 2 / 2.0)
        assert c["p_high"] == pytest.approx(3 * z**2 - 2 * z**3, rel=1e-9)
    assert report["geometric_mean_ratio"] == pytest.approx(4.5**0.5)
    assert report["largest"]["protocol"] == "p1" and report["cells_over_expected"] == 1
    assert report["p_min_of_k"] == pytest.approx(1 - (1 - first["p_high"]) ** 2)


def test_seed_scatter_counts_which_runs_score_lower_on_validation():
    """run_gaps: val - test per seeded row and seed, the family's and the others' runs lower on
    validation, Fisher's exact test of that 2 x 2 table; a start without seeds is left out."""
    from scipy import stats

    module = _script("seed_scatter")

    def row(name, test, val):
        return {
            "experiment": name,
            "cells": {"top1": {"seeds": dict(enumerate(test))}, "val_top1": {"seeds": dict(enumerate(val))}},
        }

    rows = [
        {"experiment": "grid_baseline", "cells": {"top1": {"value": 80.0}}},
        row("grid_bspf", [86.0, 86.5, 86.2], [85.5, 86.0, 86.4]),
        row("grid_ft", [87.0, 87.1, 87.3], [87.5, 87.4, 87.2]),
    ]
    gaps = module.run_gaps(rows, "bspf")
    assert list(gaps["rows"]) == ["grid_bspf", "grid_ft"]
    assert gaps["rows"]["grid_bspf"] == {
        "0": pytest.approx(-0.5),
        "1": pytest.approx(-0.5),
        "2": pytest.approx(0.2),
    }
    assert gaps["lower_on_val"]["family"] == [2, 1] and gaps["lower_on_val"]["others"] == [1, 2]
    assert gaps["fisher_p"] == pytest.approx(stats.fisher_exact([[2, 1], [1, 2]]).pvalue)
    assert gaps["mean_gap"]["family"] == pytest.approx(-0.8 / 3) and gaps["mean_gap"][
        "others"
    ] == pytest.approx(0.7 / 3)
    assert gaps["family_minus_others"] == pytest.approx(-0.5)
    # family gaps (-0.5, -0.5, 0.2) against (0.5, 0.3, -0.1): the exact two-sided p of U
    assert gaps["mannwhitney_p"] == pytest.approx(
        stats.mannwhitneyu([-0.5, -0.5, 0.2], [0.5, 0.3, -0.1]).pvalue
    )
    assert gaps["mannwhitney_p"] < 0.5
    only = module.run_gaps(rows[:2], "bspf")
    assert only["family_minus_others"] is None and only["mannwhitney_p"] is None


def test_seed_scatter_compares_the_family_gap_start_by_start():
    """start_gaps: runs are grouped by the start they loaded, each start gives one family - others gap,
    and the spread and interval across starts have starts - 1 degrees of freedom (never the runs')."""
    from scipy import stats

    from vitexp.ledger import Ledger

    module = _script("seed_scatter")

    def run(rid, start, draw):
        return {
            "run_id": rid,
            "experiment": rid,
            "kind": "train",
            "status": "completed",
            "config": {"backbone": {"pretrained": f"run:{start}"}, "data": {"split_seed": draw}},
            "started": "2026-12-01T00:00:00+00:00",
        }

    starts = [run(s, None, d) | {"config": {"backbone": {}}} for s, d in (("A", 0), ("B", 0), ("C", 1))]
    runs, rows = [], []
    gaps = {"A": (-0.5, 0.5), "B": (-0.1, 0.1), "C": (0.2, 0.0)}  # (family, others) per start
    for start, (fam, oth) in gaps.items():
        for name, gap in ((f"grid_{start}_bspf", fam), (f"grid_{start}_ft", oth)):
            ids = [f"{name}/{seed}" for seed in range(3)]
            runs += [run(i, start, {"A": 0, "B": 0, "C": 1}[start]) for i in ids]
            test = {seed: 88.0 + seed for seed in range(3)}
            rows.append(
                {
                    "experiment": name,
                    "cells": {
                        "top1": {"seeds": test, "run_ids": ids},
                        "val_top1": {"seeds": {k: v + gap for k, v in test.items()}},
                    },
                }
            )
    ledger = Ledger(starts + runs)
    out = module.start_gaps([rows[:2], rows[2:]], "bspf", ledger)
    values = [-1.0, -0.2, 0.2]
    assert [round(s["family_minus_others"], 6) for s in out["starts"].values()] == values
    assert [s["draw"] for s in out["starts"].values()] == [0, 0, 1]
    assert out["n_starts"] == 3 and out["df"] == 2
    assert out["std"] == pytest.approx(stats.tstd(values))
    assert out["half95"] == pytest.approx(stats.t.ppf(0.975, 2) * stats.tstd(values) / 3**0.5)
    one = module.start_gaps([rows[:2]], "bspf", ledger)
    assert one["n_starts"] == 1 and one["std"] is None and one["half95"] is None


def test_seed_scatter_splits_a_tables_rows_by_the_start_their_runs_loaded():
    """run_gaps never pools two starts: a table holding rows of two starts is split into one set of
    rows per start, each keeping only its start's seeds."""
    module = _script("seed_scatter")
    rows = [
        {
            "experiment": name,
            "cells": {
                "top1": {"seeds": {0: 1.0, 1: 2.0}, "run_ids": [f"{start}-0", f"{start}-1"]},
                "val_top1": {"seeds": {0: 1.5, 1: 2.5}},
                "gmacs": {"value": 1.0},
            },
        }
        for name, start in (("a_ft", "A"), ("a_bspf", "A"), ("b_ft", "B"))
    ]
    split = module.rows_by_start(rows, lambda rid: f"run:{rid.split('-')[0]}")
    assert sorted(split) == ["run:A", "run:B"]
    assert [r["experiment"] for r in split["run:A"]] == ["a_ft", "a_bspf"]
    assert split["run:B"][0]["cells"]["val_top1"]["seeds"] == {0: 1.5, 1: 2.5}
    mixed = [
        {
            **rows[0],
            "cells": {**rows[0]["cells"], "top1": {**rows[0]["cells"]["top1"], "run_ids": ["A-0", "B-1"]}},
        }
    ]
    by = module.rows_by_start(mixed, lambda rid: f"run:{rid.split('-')[0]}")
    assert by["run:A"][0]["cells"]["top1"]["seeds"] == {0: 1.0} and by["run:B"][0]["cells"]["top1"][
        "seeds"
    ] == {1: 2.0}


def test_the_docs_state_the_committed_seed_scatter_and_start_gaps_numbers():
    """The numbers docs/fashion-mnist.md types from results/analysis/fmnist_bspf_protocols_seed_scatter.json
    are that file's (a regenerated report that moves them fails here until the page says so)."""
    import json

    from vitexp import PROJECT_ROOT

    report = json.loads(
        (PROJECT_ROOT / "results" / "analysis" / "fmnist_bspf_protocols_seed_scatter.json").read_text()
    )
    page = " ".join((PROJECT_ROOT / "docs" / "fashion-mnist.md").read_text().split())
    gaps = report["start_gaps"]
    stated = {
        f"geometric mean of {report['geometric_mean_ratio']:.2f}",
        f"{report['cells_under_1']} cells are below 1 and {report['cells_over_expected']} above 1.41",
        f"({report['p_min_of_k']:.2f}, cells treated as independent",
        f"a mean of {gaps['mean']:.2f} with a 95 % interval of about ± {gaps['half95']:.1f}".replace(
            "-", "−"
        ),
    }
    values = sorted(round(s["family_minus_others"], 2) for s in gaps["starts"].values())
    stated.add(f"{values[0]:.2f}".replace("-", "−"))
    for text in stated:
        assert text in page, text
