"""The rehearsal (``vitexp-sweep TABLE --rehearse``, vitexp/cost/rehearsal/): full-size rows for a few
steps on synthetic data, one ledger entry of kind ``rehearsal`` per row, never a table cell.

Default suite: the overrides a row gets, the kind filter of the tables, a failing row recorded while
the next one runs, and one full-size row per objective in process (batch 1, 2 steps). ``-m slow``:
every row of every table, and each objective under DDP (2 gloo processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import cli_env, ledger_entries

from vitexp.config.rows import composed_config, composing, expand_rows, row_name
from vitexp.cost.rehearsal import KIND, Settings, rehearsal_jobs, rehearse_table
from vitexp.report.tables import all_specs, load_spec


def _row(table: str, name: str) -> dict:
    rows = [r for r in expand_rows(load_spec(table)["rows"]) if r.get("experiment") and row_name(r) == name]
    assert rows, f"{name} is not a row of {table}"
    return rows[0]


def _spec(*rows: dict, name: str = "t", seeds=None) -> dict:
    return {
        "name": name,
        "title": name,
        "columns": [{"key": "top1", "label": "Top-1", "unit": "%"}],
        "rows": list(rows),
        **({"seeds": seeds} if seeds else {}),
    }


def _overrides(job) -> dict[str, str]:
    return dict(a.lstrip("+").split("=", 1) for a in job.arguments)


def test_a_rows_rehearsal_is_the_row_on_synthetic_data_of_its_size_with_its_recipe():
    deit = _row("bspf_table1", "deit_small_baseline")
    raptor = _row("saper_table1", "raptor_vitb14_k2_in1k")
    coco = _row("bspf_coco", "maskrcnn_shvit_s4_coco")
    cifar = _row("saper_table1", "saper_kd_vits14_k6_c100")
    jobs = {j.name: j for j in rehearsal_jobs(_spec(deit, raptor, coco, cifar), Settings(batch=2, steps=3))}
    d = _overrides(jobs["deit_small_baseline+rehearsal"])
    assert d["experiment"] == "deit_small_baseline" and d["name"] == "'deit_small_baseline+rehearsal'"
    assert (d["data"], d["data.num_classes"], d["data.num_train"], d["data.num_test"]) == (
        "synthetic",
        "1000",
        "6",
        "4",
    )
    assert (d["trainer"], d["trainer.precision"], d["trainer.max_steps"], d["recipe.batch_size"]) == (
        "cpu",
        "bf16-mixed",
        "3",
        "2",
    )  # the GPU recipe's bf16 autocast, on the CPU too
    assert d["backbone.pretrained"] == "null" and d["logger"] == "none"
    r = _overrides(jobs["raptor_vitb14_k2_in1k+rehearsal"])
    assert (r["method.probe.batch_size"], r["method.phase_images"]) == (
        "2",
        "6",
    )  # every stage at the same batch
    c = _overrides(jobs["maskrcnn_shvit_s4_coco+rehearsal"])
    assert (c["data"], c["data.num_classes"], c["data.generate"]) == (
        "synthetic_coco",
        "80",
        "{height:800,width:1280,max_items:4}",
    )
    assert _overrides(jobs["saper_kd_vits14_k6_c100+rehearsal"])["data.num_classes"] == "100"
    ddp = {j.name: j for j in rehearsal_jobs(_spec(deit), Settings(batch=None, steps=2, trainer="ddp_cpu"))}
    g = _overrides(ddp["deit_small_baseline+rehearsal"])
    # the recipe's per-device batch; both processes get `steps` batches
    assert (g["trainer"], g["trainer.devices"], g["recipe.batch_size"], g["data.num_train"]) == (
        "ddp_cpu",
        "2",
        "128",
        "512",
    )
    with pytest.raises(ValueError, match="at least 2 steps"):
        Settings(steps=1)


def test_a_rows_real_data_options_stay_out_of_its_rehearsal():
    """fmnist_recipe's augmentation row sets data.augment, an option of Fashion-MNIST that the
    rehearsal's synthetic data does not have: the rehearsal leaves it out and composes."""
    from vitexp.config.composition import compose

    row = _row("fmnist_recipe", "fmnist_vit_micro_baseline_augment")
    (job,) = rehearsal_jobs(_spec(row), Settings(batch=2, steps=2))
    assert job.config["data"]["augment"] is True and "data.augment" not in _overrides(job)
    assert compose(list(job.arguments)).data.name == "synthetic"


def test_a_rehearsal_never_fills_a_table_cell(results_dir):
    """Even under the row's own name and with the row's own configuration, a rehearsal is not a run of the
    row."""
    from vitexp.ledger import Ledger
    from vitexp.ledger import fingerprint as fp
    from vitexp.report.tables import fill

    spec = _spec({"label": "DeiT-S", "experiment": "deit_small_baseline"})
    with composing():
        config = composed_config(["experiment=deit_small_baseline"], None)
    record = {
        "run_id": "20260101-000000-rehearsal-deit_small_baseline-abcdef",
        "experiment": "deit_small_baseline",
        "status": "completed",
        "kind": KIND,
        "config": config,
        "fingerprint": fp.fingerprint(config),
        "metrics": {"top1": 12.5},
        "started": "2026-01-01T00:00:00+00:00",
    }
    cell = fill(spec, Ledger.of([record]))[0]["cells"]["top1"]
    assert cell.get("value") is None, cell
    assert (
        fill(spec, Ledger.of([{**record, "kind": "train"}]))[0]["cells"]["top1"]["value"] == 12.5
    )  # the same as a train run


@pytest.mark.slow  # about 45 s of CPU: two row processes
def test_a_failing_row_is_a_failed_entry_and_the_next_row_runs(results_dir, tmp_path):
    """Through vitexp-sweep: a row the run refuses (invalid budget) and a row that does not compose
    are failed entries with their error; the micro row after them completes with its measurements."""
    spec_dir = tmp_path / "sweeps"
    spec = _spec(
        {"label": "bad budget", "experiment": "bspf_demo", "overrides": ["budget.keep_ratio=1.5"]},
        {"label": "gone", "experiment": "demo", "overrides": ["recipe.no_such_key=1"]},
        {"label": "demo", "experiment": "demo"},
        name="rehearsal_check",
    )
    spec_dir.mkdir()
    (spec_dir / "rehearsal_check.yaml").write_text(json.dumps(spec))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitexp.commands.cli",
            "sweep",
            str(spec_dir / "rehearsal_check.yaml"),
            "--rehearse",
            "--rehearse-steps",
            "2",
            "--rehearse-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=cli_env(results_dir),
        timeout=600,
    )
    closing = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 1 and closing["status"] == "failed", out.stderr[-2000:]
    entries = {e["experiment"]: e for e in ledger_entries(results_dir)}
    bad = entries["bspf_demo+budget.keep_ratio=1.5+rehearsal"]
    assert bad["kind"] == KIND and bad["status"] == "failed" and "keep_ratio" in bad["error"]
    assert entries["demo+recipe.no_such_key=1+rehearsal"]["status"] == "failed"
    demo = entries["demo+rehearsal"]
    assert demo["status"] == "completed" and demo["kind"] == KIND, demo.get("error")
    m = demo["metrics"]
    assert m["device"] == "cpu" and m["batch_size"] == 2 and m["peak_rss_mb"] > 50
    assert m["step_s"] > 0 and m["images_per_s"] == pytest.approx(2 / m["step_s"])
    assert m["stages"]["main"]["train_gflops_per_image"] > 0 and m["gmacs"] > 0
    assert not list((tmp_path / "out").rglob("weights.pth"))  # random weights are not kept
    assert "no_such_key" in entries["demo+recipe.no_such_key=1+rehearsal"]["error"]
    again = rehearse_table(
        load_spec(spec_dir / "rehearsal_check.yaml"),
        Settings(steps=2),
        results_dir,
        tmp_path / "out",
        dry_run=True,
    )
    assert list(again["skipped"]) == ["demo+rehearsal"]  # done already; the failed rows would run again


#: One full-size row per objective: classification fine-tune, SAPER distill (k-NN), RAPTOR's stages, Mask
#: R-CNN.
PER_OBJECTIVE = [
    ("bspf_table1", "deit_tiny_baseline"),
    ("saper_table1", "saper_kd_vits14_k6_in1k"),
    ("saper_table1", "raptor_vits14_k2_in1k"),
    ("bspf_coco", "maskrcnn_shvit_s4_coco"),
]


#: About 70 s together on 2 loaded cores (Mask R-CNN at 1280 x 800: half of it); the default suite runs
#: one row of each objective, the slow set every row of every table.
@pytest.mark.parametrize("table,name", PER_OBJECTIVE)
def test_a_full_size_row_of_each_objective_rehearses(table, name, make_cfg, results_dir, tmp_path):
    """In process (no interpreter start): batch 1, 2 steps per stage, one evaluation batch."""
    from vitexp.commands.rehearse import rehearse

    (job,) = rehearsal_jobs(_spec(_row(table, name)), Settings(batch=1, steps=2, eval_batches=1))
    rehearse(make_cfg(job.arguments, tmp_path / "run"))
    (entry,) = ledger_entries(results_dir)
    assert (entry["kind"], entry["status"], entry["experiment"]) == (
        KIND,
        "completed",
        f"{name}+rehearsal",
    ), entry.get("error")
    m = entry["metrics"]
    assert m["stages"] or name.startswith("knn"), m
    for stage, s in m["stages"].items():
        assert (
            s["timed_steps"] == 1 and s["step_s"] > 0 and s["batch"] == 1 and s["train_gflops_per_image"] > 0
        ), stage
    assert m["gflops"] > 0 and m["peak_rss_mb"] > 0 and m["device"] == "cpu"
    assert entry["config"]["trainer"]["precision"] == "bf16-mixed"
    if name.startswith("raptor"):
        assert set(m["stages"]) == {"stage1", "stage2", "probe", "teacher_probe"}
    if name.startswith("saper"):
        assert set(m["stages"]) == {"select", "recover"} and m["top1"] is not None  # the k-NN evaluation ran


@pytest.mark.slow
@pytest.mark.parametrize("table", all_specs())
def test_every_row_of_every_table_rehearses(table, results_dir, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitexp.commands.cli",
            "sweep",
            table,
            "--rehearse",
            "--rehearse-steps",
            "2",
            "--rehearse-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=cli_env(results_dir),
        timeout=6 * 3600,
    )
    closing = json.loads(out.stdout.strip().splitlines()[-1])
    assert closing["status"] == "completed", (closing["failed"], out.stderr[-3000:])
    assert all(e["status"] == "completed" and e["kind"] == KIND for e in ledger_entries(results_dir))


@pytest.mark.slow
@pytest.mark.parametrize("table,name", PER_OBJECTIVE)
def test_each_objective_rehearses_under_ddp(table, name, results_dir, tmp_path):
    """trainer=ddp_cpu: 2 gloo processes, the row's recipe at batch 1 per process."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitexp.commands.cli",
            "sweep",
            table,
            "--rehearse",
            "--rehearse-only",
            name,
            "--rehearse-trainer",
            "ddp_cpu",
            "--rehearse-batch",
            "1",
            "--rehearse-steps",
            "2",
            "--rehearse-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=cli_env(results_dir),
        timeout=1800,
    )
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed", (entry.get("error"), out.stderr[-3000:])
    assert entry["metrics"]["world_size"] == 2 and entry["config"]["trainer"]["strategy"] == "ddp"


@pytest.mark.parametrize("mode", ["ft", "kd"])
def test_every_trainable_parameter_of_a_saper_recovery_gets_a_gradient(mode, make_cfg):
    """What DDP needs (no find_unused_parameters): with k = 1 of 16 heads, most layers keep no head,
    and their norm1 feeds nothing; the DDP rehearsal of a full-size distill row failed on it."""
    import torch

    from vitexp.training.build import build_backbone_and_method
    from vitexp.training.fit import stage_module

    cfg = make_cfg(
        [
            "experiment=saper_micro",
            f"method=saper_{mode}",
            "budget.k=1",
            "backbone.pretrained=null",
            "method.recover_epochs=1",
        ]
    )
    backbone, method, _ = build_backbone_and_method(cfg)
    recover = method.stages(method.apply(backbone, cfg.budget))[-1]
    assert recover.name == "recover"
    module = stage_module(cfg, recover)
    x = torch.randn(2, 3, int(cfg.backbone.img_size), int(cfg.backbone.img_size))
    out = module.distill_loss(x) if mode == "kd" else module.model(x).sum()
    out.backward()
    assert [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None] == []


def test_only_names_rows_and_a_spent_budget_starts_none(results_dir, tmp_path):
    spec = _spec(
        {"label": "DeiT-S", "experiment": "deit_small_baseline"},
        {"label": "BSPF", "experiment": "bspf_deit_small"},
    )
    with pytest.raises(ValueError, match="not rows of t"):
        rehearse_table(spec, Settings(), results_dir, tmp_path, only=["nope"])
    out = rehearse_table(
        spec, Settings(), results_dir, tmp_path, only=["deit_small_baseline", "bspf_deit_small"], budget_s=0
    )
    assert out["status"] == "partial" and out["not_reached"] == [
        "deit_small_baseline+rehearsal",
        "bspf_deit_small+rehearsal",
    ]
    assert ledger_entries(results_dir) == []
    # 100 s left but a row may take its timeout, 300 s: it is not started (seen to fail when the budget
    # only stopped rows from starting once spent: the row ran)
    out = rehearse_table(
        spec, Settings(), results_dir, tmp_path, only=["deit_small_baseline"], budget_s=100, timeout=300
    )
    assert out["not_reached"] == ["deit_small_baseline+rehearsal"] and ledger_entries(results_dir) == []


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["data=digits"], "data=digits is not synthetic"),
        (
            ["data=micro_coco", "objective=detect", "backbone=shvit_micro"],
            "data=micro_coco is not synthetic_coco",
        ),
    ],
)
def test_a_rehearsal_refuses_real_data_naming_its_objectives_synthetic_data(overrides, named, make_cfg):
    from vitexp.commands.rehearse import rehearse
    from vitexp.errors import ConfigError

    cfg = make_cfg([*overrides, "+trainer.max_steps=2"])
    with pytest.raises(ConfigError, match=named):
        rehearse(cfg)
