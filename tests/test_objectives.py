"""Objectives as plug-ins (vitexp/training/objectives/): train, evaluate, flops and bench ask the run's
objective what to train, test and count, never which objective it is; a detector run is
re-evaluated by vitexp-eval like a classifier."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import QUIET, ledger_entries

ROOT = Path(__file__).resolve().parent.parent
#: Where the detection objective may be named: its plug-in, its LightningModule, its config group's schema
#: and the package it wraps.
PLUGINS = (
    "vitexp/training/objectives/",
    "vitexp/training/detection_module.py",
    "vitexp/config/objective_schemas.py",
    "vitexp/detection/",
)
#: The objective's words (detect, detection, detector, DetectModule, wants_detection ...); the
#: English verb's other forms ("Lightning detects", "was detected": a statistical test) are not it.
OBJECTIVE_WORD = re.compile(r"detect(?!s\b|ed\b)", re.IGNORECASE)
#: Mentions that are not the objective (Lightning's API), and its config group's owner, which
#: the ledger's fingerprint declares below the training code (docs/layout.md).
ALLOWED = {
    "vitexp/runs/slurm.py": ("SLURMEnvironment.detect()",),
    "vitexp/ledger/fingerprint.py": ('GROUP_OWNERS: dict[str, str] = {"detector": "detect"}',),
}


def test_no_module_outside_the_objective_plugins_names_detection():
    found = []
    for path in sorted((ROOT / "vitexp").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(PLUGINS):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if OBJECTIVE_WORD.search(line) and not any(allowed in line for allowed in ALLOWED.get(rel, ())):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["objective=segment"], "objective='segment': valid choices are ['auto', 'detect']"),
        (["objective=detect", "backbone=caformer_micro"], "data: objective=detect needs a detection dataset"),
        (["objective=detect", "data=micro_coco"], "backbone: objective=detect needs a backbone with stages"),
    ],
)
def test_the_objective_is_checked_before_anything_is_built(overrides, message, make_cfg):
    from vitexp.errors import ConfigError
    from vitexp.training.resolve import validate

    with pytest.raises(ConfigError) as err:
        validate(make_cfg(overrides), need_data=False)
    assert str(err.value).startswith(message)


def test_vitexp_bench_refuses_a_detector_before_its_entry(make_cfg, results_dir):
    """Invalid, nothing written: the protocol does not time detectors (vitexp-flops counts them)."""
    from vitexp.commands.bench import run_bench
    from vitexp.errors import ConfigError

    with pytest.raises(ConfigError, match="a detector's throughput is not measured"):
        run_bench(make_cfg(QUIET + ["experiment=micro_coco_caformer", "data.root=/nonexistent"]))
    assert ledger_entries(results_dir) == []


#: A micro detector (with ``experiment=micro_coco_caformer``) after one step on 4 canvases of 64 px,
#: tested on 8 (data seed 5: some of its detections hit, so its box and mask AP are not 0 and their
#: equality says something).
MICRO_DETECTOR = QUIET + [
    "data.generate.n_train=4",
    "data.generate.n_val=8",
    "data.generate.size=64",
    "data.generate.source=digits",
    "data.generate.seed=5",
    "backbone.img_size=64",
    "detector.min_size=64",
    "detector.max_size=64",
    "detector.flops_size=[64,64]",
    "recipe.batch_size=4",
    "recipe.epochs=1",
    "recipe.decay_epochs=[1]",
    "recipe.warmup_steps=2",
    "trainer.num_sanity_val_steps=0",
]


@pytest.mark.parametrize("experiment", ["micro_coco_caformer", "micro_coco_bspf_caformer"])
def test_eval_reproduces_a_micro_detector_runs_box_and_mask_ap(
    experiment, make_cfg, results_dir, tmp_path, capsys
):
    """The detector a run saved (weights.pth: the whole Mask R-CNN) is rebuilt from the run's config,
    tested on the same split, and gives the ledger's ap_box and ap_mask, also when the rebuilt model
    starts from another seed's initialisation (the saved weights decide)."""
    from vitexp.commands.cli import eval_main
    from vitexp.commands.train import train

    trained = train(
        make_cfg(
            MICRO_DETECTOR + [f"experiment={experiment}", f"data.root={tmp_path / 'coco'}"], tmp_path / "run"
        )
    )
    # some detections hit: the equality below compares more than zeros
    assert (
        trained["metrics"]["ap_box"] > 0
        and trained["metrics"]["ap_mask"] > 0
        and "top1" not in trained["metrics"]
    )
    capsys.readouterr()
    eval_main([trained["run_id"], "logger=none", "trainer.enable_progress_bar=false", "seed=7"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["status"] == "completed" and result["evaluates"] == trained["run_id"]
    for key in ("ap_box", "ap_mask", "ap_box_50", "ap_mask_75"):
        assert result["metrics"][key] == pytest.approx(trained["metrics"][key], abs=1e-9), key
    assert sorted(e["kind"] for e in ledger_entries(results_dir)) == ["eval", "train"]


def test_objective_groups_are_declared_once_for_the_schema_and_the_fingerprint():
    """Each plug-in's own groups are the ones the fingerprint leaves out of other objectives' runs
    (vitexp.ledger.fingerprint.GROUP_OWNERS) with the schema config/schema.py checks them by."""
    from vitexp.config.objective_schemas import OBJECTIVE_SCHEMAS
    from vitexp.ledger.fingerprint import GROUP_OWNERS
    from vitexp.training.objectives import OBJECTIVES, objective_for

    owned = {}
    for name in OBJECTIVES:
        for group, schema in objective_for({"objective": name}).config_groups.items():
            owned[group] = name
            assert OBJECTIVE_SCHEMAS[group] is schema
    assert owned == GROUP_OWNERS
    assert set(OBJECTIVE_SCHEMAS) == set(GROUP_OWNERS)
