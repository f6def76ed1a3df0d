"""Training end to end on the CPU: fast_dev_run per backbone x method, the demo's accuracy,
NaN loss, exact resume, bad checkpoints and datasets, the W&B offline logger."""

from __future__ import annotations

import pytest
import torch
from conftest import QUIET, ledger_entries, pairwise
from lightning.pytorch.callbacks import Callback

import vitexp.config.composition as vconfig
from vitexp import CONF_DIR
from vitexp.commands.train import train
from vitexp.models import CheckpointMismatchError, build_backbone
from vitexp.training import resolve
from vitexp.training.modules import NonFiniteLossError

#: micro-scale backbones: one fast_dev_run each per method (full-size ones are built in test_config)
BACKBONES = sorted(p.stem for p in (CONF_DIR / "backbone").glob("*.yaml") if "micro" in p.stem)
METHODS = sorted(p.stem for p in (CONF_DIR / "method").glob("*.yaml"))
SMALL = QUIET + [
    "data=synthetic",
    "data.num_train=16",
    "data.num_val=8",
    "data.num_test=8",
    "recipe.batch_size=4",
    "eval.throughput_batch=2",
    "eval.throughput_iters=1",
]


def budget_for(method: str) -> str:
    """The first budget kind a method accepts (each kind is a conf/budget option)."""
    from vitexp.methods import method_from_config

    return method_from_config(vconfig.compose([f"method={method}"]).method).budget_kinds[0]


@pytest.mark.parametrize(("backbone", "method"), pairwise(BACKBONES, METHODS))
def test_fast_dev_run(backbone, method, make_cfg, results_dir):
    budget = budget_for(method)
    cfg = make_cfg(
        SMALL
        + [f"backbone={backbone}", f"method={method}", f"budget={budget}", "trainer.fast_dev_run=true"]
        + (["budget.k=3"] if budget == "heads" else [])
    )
    try:
        resolve.validate(cfg)
    except vconfig.ConfigError as err:
        if "does not apply" in str(err):
            pytest.skip(str(err))
        raise
    result = train(cfg)
    m = result["metrics"]
    assert 0 <= m["top1"] <= 100 and m["gmacs"] > 0 and m["throughput"] > 0
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed" and entry["kind"] == "train"
    assert entry["protocol"]["resolution"] == cfg.backbone.img_size
    assert entry["protocol"]["data_order"] == "seed*1000003+epoch"  # what the sweep tells old seeds by


@pytest.mark.slow  # about 90 s on 2 cores; the demo table's run records the same (results/tables/demo.md)
def test_demo_reaches_85_percent_on_digits(make_cfg, results_dir):
    """The default experiment (micro ViT on the real digits, 30 epochs) on the CPU."""
    cfg = make_cfg(QUIET + ["eval.throughput=false"])
    assert cfg.name == "demo"
    metrics = train(cfg)["metrics"]
    assert metrics["top1"] >= 85.0
    assert 0.1 <= metrics["params_m"] <= 0.5
    (entry,) = ledger_entries(results_dir)
    assert entry["experiment"] == "demo" and entry["metrics"]["top1"] == pytest.approx(metrics["top1"])


def test_nan_loss_stops_the_run_and_marks_it_failed(make_cfg, results_dir):
    cfg = make_cfg(SMALL + ["data.noise=nan", "recipe.epochs=1", "recipe.warmup_epochs=0"])
    with pytest.raises(NonFiniteLossError, match="training loss is nan"):
        train(cfg)
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "failed" and "NonFiniteLossError" in entry["error"]


class _CrashAtEpoch(Callback):
    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise RuntimeError("simulated crash")


def test_resume_matches_an_uninterrupted_run(make_cfg, results_dir, tmp_path):
    """Interrupted after epoch 1, resumed: same test metrics as a run never interrupted
    (mixup, cutmix and drop path on, so the RNG state must travel with the checkpoint)."""
    over = QUIET + [
        "data=synthetic",
        "data.num_train=64",
        "recipe.batch_size=16",
        "recipe.epochs=3",
        "recipe.warmup_epochs=1",
        "recipe.mixup=0.8",
        "recipe.cutmix=1.0",
        "recipe.drop_path=0.1",
        "eval.throughput=false",
        "eval.flops=false",
    ]
    whole = train(make_cfg(over, tmp_path / "whole"))["metrics"]
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(over, tmp_path / "split"), callbacks=[_CrashAtEpoch(1)])
    resumed = train(make_cfg(over + ["resume=true"], tmp_path / "split"))["metrics"]
    assert resumed["steps"] == whole["steps"]
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-5, abs=1e-6)
    assert resumed["top1"] == pytest.approx(whole["top1"])
    entries = ledger_entries(results_dir)  # the resumed run continues its own (failed) entry
    assert sorted(e["status"] for e in entries) == ["completed", "completed"]
    assert [a["status"] for e in entries for a in e.get("attempts", [])] == ["failed"]
    assert [e["protocol"]["data_order"] for e in entries] == ["seed*1000003+epoch"] * 2


def test_a_run_resumed_from_a_checkpoint_of_the_old_sampler_is_not_marked_independent(
    make_cfg, results_dir, tmp_path
):
    """A checkpoint without the order mark was drawn by the ``seed + epoch`` sampler: the resumed
    run records ``data_order_resumed_from`` instead of ``data_order``, and so does a run requeued
    again from a checkpoint that resumed run wrote; a seed >= 1 run so recorded counts as
    overlapping (the sweep trains it again)."""
    from vitexp.report.aggregate import overlapping_order
    from vitexp.runs.callbacks import DataOrderMark

    over = SMALL + [
        "recipe.epochs=3",
        "recipe.warmup_epochs=0",
        "eval.throughput=false",
        "eval.flops=false",
        "seed=1",
    ]
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(over, tmp_path / "split"), callbacks=[_CrashAtEpoch(1)])
    ckpt = tmp_path / "split" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=False)
    assert state.pop(DataOrderMark.KEY) == "seed*1000003+epoch"
    torch.save(state, ckpt)
    with pytest.raises(RuntimeError, match="simulated crash"):  # resumed, then requeued once more
        train(make_cfg(over + ["resume=true"], tmp_path / "split"), callbacks=[_CrashAtEpoch(2)])
    assert torch.load(ckpt, weights_only=False)[DataOrderMark.KEY] == "seed+epoch"
    train(make_cfg(over + ["resume=true"], tmp_path / "split"))
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed" and entry["metrics"]["steps"] > 0
    assert (
        "data_order" not in entry["protocol"] and entry["protocol"]["data_order_resumed_from"] == "seed+epoch"
    )
    assert overlapping_order(entry)


def test_resume_without_checkpoint_names_the_path(make_cfg, tmp_path, results_dir):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "fresh" / "checkpoints" / "last.ckpt")):
        train(make_cfg(SMALL + ["resume=true"], tmp_path / "fresh"))
    assert ledger_entries(results_dir)[0]["status"] == "failed"


def test_pretrained_weights_load_from_a_local_file_only(tmp_path):
    cfg = vconfig.compose([]).backbone
    model = build_backbone(cfg, num_classes=10)
    path = tmp_path / "micro.pth"
    torch.save({"model": model.state_dict()}, path)  # the DeiT release layout
    loaded = build_backbone({**cfg, "pretrained": str(path)}, num_classes=10)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k


def test_checkpoint_with_wrong_keys_names_them(tmp_path):
    cfg = vconfig.compose([]).backbone
    state = build_backbone(cfg, num_classes=10).state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["blocks.0.norm1.weight"]
    path = tmp_path / "bad.pth"
    torch.save(state, path)
    with pytest.raises(CheckpointMismatchError) as err:
        build_backbone({**cfg, "pretrained": str(path)}, num_classes=10)
    assert "blocks.0.norm1.weight" in str(err.value) and "extra.weight" in str(err.value)
    assert str(path) in str(err.value)


def test_missing_checkpoint_file_names_the_path(tmp_path):
    cfg = vconfig.compose([]).backbone
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "none.pth")):
        build_backbone({**cfg, "pretrained": str(tmp_path / "none.pth")}, num_classes=10)


def test_wandb_offline_logger_records_config_and_metrics(make_cfg, results_dir, tmp_path, monkeypatch):
    """W&B (offline here) receives the resolved config and the final metrics, FLOPs, params and
    throughput: read back from the run object as it finishes."""
    from wandb.sdk.wandb_run import Run

    seen = {}
    original_finish = Run.finish

    def spy_finish(self, *args, **kwargs):
        seen["config"] = dict(self.config)
        seen["summary"] = {k: self.summary[k] for k in self.summary.keys()}
        seen["offline"] = self.offline
        return original_finish(self, *args, **kwargs)

    monkeypatch.setattr(Run, "finish", spy_finish)
    cfg = make_cfg(
        SMALL
        + ["logger=wandb", "recipe.epochs=1", "recipe.warmup_epochs=0", "trainer.limit_train_batches=2"],
        tmp_path / "wb",
    )
    metrics = train(cfg)["metrics"]
    assert seen["offline"] is True
    assert seen["config"]["name"] == cfg.name and seen["config"]["recipe"]["lr"] == cfg.recipe.lr
    for key in ("top1", "gmacs", "gflops", "params_m", "throughput"):
        assert seen["summary"][key] == pytest.approx(metrics[key]), key
    (entry,) = ledger_entries(results_dir)
    assert entry["wandb_url"].startswith("offline:")
    assert len(list((tmp_path / "wb" / "wandb").glob("offline-run-*"))) == 1


def test_imagefolder_and_csv_logger_through_the_same_program(make_cfg, results_dir, tmp_path):
    """The paper-scale path (ImageFolder layout, timm transforms) at micro size, logged to CSV."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    root = tmp_path / "tiny_imagenet"
    for split in ("train", "val"):
        for cls in ("a", "b", "c"):
            (root / split / cls).mkdir(parents=True)
            for i in range(4):
                Image.fromarray(rng.integers(0, 255, (36, 36, 3), dtype=np.uint8)).save(
                    root / split / cls / f"{i}.png"
                )
    cfg = make_cfg(
        QUIET
        + [
            "data=imagefolder",
            f"data.root={root}",
            "data.num_classes=3",
            "data.num_workers=0",
            "recipe=deit_scratch",
            "recipe.epochs=2",
            "recipe.warmup_epochs=1",
            "recipe.batch_size=4",
            "logger=csv",
            "eval.throughput_batch=2",
            "eval.throughput_iters=1",
        ],
        tmp_path / "if",
    )
    metrics = train(cfg)["metrics"]
    assert metrics["epochs"] == 2 and 0 <= metrics["top1"] <= 100
    log = (tmp_path / "if" / "csv" / "metrics.csv").read_text()
    assert "val/top1" in log and "train/loss_epoch" in log
    assert ledger_entries(results_dir)[0]["config"]["recipe"]["mixup"] == 0.8


@pytest.mark.parametrize("backbone", ["lvvit_micro", "t2t_vit_micro", "caformer_micro"])
def test_bspf_trains_on_digits_on_each_micro_backbone(backbone, make_cfg, results_dir, tmp_path):
    cfg = make_cfg(
        QUIET
        + [
            f"backbone={backbone}",
            "method=bspf",
            "budget=keep_ratio",
            "recipe.epochs=1",
            "recipe.warmup_epochs=0",
            "trainer.limit_train_batches=4",
            "trainer.limit_val_batches=2",
            "trainer.limit_test_batches=2",
            "eval.throughput_batch=4",
            "eval.throughput_iters=1",
        ],
        tmp_path / backbone,
    )
    metrics = train(cfg)["metrics"]
    assert metrics["steps"] == 4 and 0 <= metrics["top1"] <= 100
    assert ledger_entries(results_dir)[0]["status"] == "completed"


def test_best_validation_top1_and_its_epoch_are_recorded(make_cfg, results_dir):
    """``best_val_top1`` is the largest of the epochs' ``val/top1`` and ``best_val_epoch`` the
    epochs trained when it was reached (the first of a tie), checked against what the epochs logged."""

    class ValAccuracies(Callback):
        def __init__(self):
            self.values: list[float] = []

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.values.append(float(trainer.callback_metrics["val/top1"]))

    seen = ValAccuracies()
    cfg = make_cfg(
        SMALL
        + [
            "data.num_train=64",
            "data.num_val=32",
            "recipe.epochs=4",
            "recipe.lr=0.05",
            "recipe.warmup_epochs=0",
            "trainer.num_sanity_val_steps=0",
        ]
    )
    metrics = train(cfg, callbacks=[seen])["metrics"]
    assert len(seen.values) == 4 and len(set(seen.values)) > 1
    best = max(seen.values)
    assert metrics["best_val_top1"] == pytest.approx(100.0 * best)
    assert metrics["best_val_epoch"] == seen.values.index(best) + 1
    assert metrics["val_top1"] == pytest.approx(100.0 * seen.values[-1])
