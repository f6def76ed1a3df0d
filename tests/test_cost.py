"""The GPU cost of a table from its rehearsals (vitexp/cost.py), and vitexp-tables writing it."""
from __future__ import annotations

import json

import pytest

from vitexp import cost
from vitexp.ledger import Ledger
from vitexp.rows import composed_config, composing

IMAGENET = cost.DATASETS["imagenet"]


def _rehearsal(name: str, device: str = "cpu", stages=None, gflops: float = 9.2, run_id: str = "r1") -> dict:
    stages = stages if stages is not None else {
        "main": {"epochs": 30, "batch": 2, "step_s": 1.0, "train_gflops_per_image": 27.6}}
    return {"run_id": f"20260101-000000-rehearsal-{run_id}", "experiment": f"{name}+rehearsal", "status": "completed",
            "kind": "rehearsal", "metrics": {"device": device, "gflops": gflops, "stages": stages},
            "started": "2026-01-01T00:00:00+00:00"}


def _config(experiment: str) -> dict:
    with composing():
        return composed_config([f"experiment={experiment}"], None)


def test_a_cpu_rehearsal_gives_an_estimate_from_the_counted_training_flops():
    config = _config("deit_small_baseline")
    c = cost.row_cost(config, _rehearsal("deit_small_baseline"))
    assert c["basis"] == "estimate"
    per_image_s = 27.6e9 / (cost.EFFECTIVE_TFLOPS * 1e12)
    assert c["train_hours"] == pytest.approx(30 * IMAGENET["train"] * per_image_s / 3600)
    # evaluation: the validation split after each of the 30 epochs and the test split, forward only
    assert c["eval_hours"] == pytest.approx((30 * IMAGENET["val"] + IMAGENET["test"]) * 9.2e9
                                            / (cost.EFFECTIVE_TFLOPS * 1e12) / 3600)
    twice = cost.row_cost(config, _rehearsal("deit_small_baseline", stages={
        "main": {"epochs": 60, "batch": 2, "step_s": 1.0, "train_gflops_per_image": 27.6}}))
    assert twice["train_hours"] == pytest.approx(2 * c["train_hours"])
    # no counted step: 3 x the forward
    rule = cost.row_cost(config, _rehearsal("deit_small_baseline", stages={"main": {"epochs": 30, "batch": 2}}))
    assert rule["train_hours"] == pytest.approx(c["train_hours"] * 3 * 9.2 / 27.6)


def test_a_gpu_rehearsal_is_measured_and_preferred():
    config = _config("deit_small_baseline")
    gpu = _rehearsal("deit_small_baseline", "cuda:NVIDIA H200", {"main": {"epochs": 30, "batch": 128, "step_s": 0.2,
                                                                           "train_gflops_per_image": 27.6}}, run_id="g")
    c = cost.row_cost(config, gpu)
    assert c["basis"] == "measured" and c["train_hours"] == pytest.approx(30 * IMAGENET["train"] * 0.2 / 128 / 3600)
    ledger = Ledger.of([gpu, _rehearsal("deit_small_baseline", run_id="newer-cpu")])
    assert cost.rehearsal_of(ledger, "deit_small_baseline")["run_id"] == gpu["run_id"]


def test_a_knn_row_pays_for_its_memory_bank():
    plain = cost.row_cost(_config("probe_vits14_in1k"), _rehearsal("x", stages={}))
    knn = cost.row_cost(_config("knn_vits14_in1k"), _rehearsal("x", stages={}))
    assert knn["eval_hours"] == pytest.approx(plain["eval_hours"] * (IMAGENET["test"] + IMAGENET["train"]) / IMAGENET["test"])


def test_a_table_sums_its_rows_times_their_seeds_and_lists_rows_without_a_rehearsal(tmp_path):
    spec = {"name": "t", "seeds": [0, 1, 2], "rows": [
        {"label": "DeiT-S", "experiment": "deit_small_baseline"},
        {"label": "BSPF", "experiment": "bspf_deit_small"}]}
    ledger = Ledger.of([_rehearsal("deit_small_baseline")])
    c = cost.table_cost(spec, ledger)
    one = cost.row_cost(_config("deit_small_baseline"), _rehearsal("deit_small_baseline"))["gpu_hours"]
    assert c["total_gpu_hours"] == pytest.approx(3 * one) and c["missing"] == ["bspf_deit_small"]
    text = cost.render_cost(c)
    assert "estimate" in text and "no completed rehearsal" in text and "1 row(s) without a cost left out" in text


def test_vitexp_tables_writes_the_cost_beside_the_table(results_dir, capsys):
    from vitexp.tables import main

    (results_dir / "runs").mkdir(parents=True)
    record = _rehearsal("deit_small_baseline")
    (results_dir / "runs" / f"{record['run_id']}.json").write_text(json.dumps(record))
    assert main(["demo", "--results-dir", str(results_dir)]) == 0
    closing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    path = results_dir / "tables" / "demo.cost.md"
    assert closing["tables"]["demo"]["cost"] and path.is_file()
    text = path.read_text()
    assert record["run_id"] in text and "no completed rehearsal" in text  # the other rows have none
