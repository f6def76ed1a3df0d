"""bf16 autocast, as the GPU table configs run (``trainer=gpu``: ``precision: bf16-mixed``): every
method config on every micro backbone it accepts trains a step under ``torch.autocast("cpu",
torch.bfloat16)``, and BSPF-DeiT-S infers at full size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import pairwise

import vitexp.config.composition as vconfig
from vitexp.training import resolve

METHODS = sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "method").glob("*.yaml"))
MICRO = sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "backbone").glob("*micro*.yaml"))
#: the budget each method accepts (RAPTOR's phases are given: Method.prepare needs no data then)
BUDGETS = {
    "bspf": ["budget=keep_ratio"],
    "evit": ["budget=keep_ratio"],
    "tome": ["budget=merge", "budget.r=2"],
    "saper_ft": ["budget=heads", "budget.k=4"],
    "saper_kd": ["budget=heads", "budget.k=4"],
    "raptor": ["budget=blocks", "budget.k=2"],
}


def _config(method: str, backbone: str):
    cfg = vconfig.compose(
        [
            f"backbone={backbone}",
            f"method={method}",
            *BUDGETS.get(method, ["budget=none"]),
            "data=synthetic",
            "logger=none",
        ]
    )
    if method == "raptor":
        depth = int(cfg.backbone.arch.depth)
        cfg.method.phases = [list(range(depth // 2)), list(range(depth // 2, depth))]
    resolve.validate(cfg, need_data=False)
    return cfg


def _stage_loss(module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss of the stage's LightningModule (vitexp.training.modules), without a Trainer."""
    from vitexp.training.modules import DistillModule, RaptorStageModule

    if isinstance(module, RaptorStageModule):
        return module.model.stage_loss(x, module.stage, 0.5)
    if isinstance(module, DistillModule) and hasattr(module.model, "distill_targets"):
        return module.distill_loss(x)
    if isinstance(module, DistillModule):  # method=knn: nothing trains; its bf16 path is the k-NN features
        return module(x).float().pow(2).mean()
    return F.cross_entropy(module(x), y)


def test_every_method_config_is_covered():
    assert {
        "baseline",
        "bspf",
        "chunk",
        "probe",
        "raptor",
        "saper_ft",
        "saper_kd",
        "tome",
        "evit",
        "knn",
    } <= set(METHODS)
    assert {"vit_micro", "caformer_micro", "dinov2_micro", "shvit_micro"} <= set(MICRO)
    for method in ("bspf", "chunk"):  # BSPF-ViT applies to SHViT: its matrix cells run, not skip
        _config(method, "shvit_micro")


@pytest.mark.parametrize(("backbone", "method"), pairwise(MICRO, METHODS))
def test_bf16_autocast_trains_every_method_on_every_micro_backbone(method, backbone):
    from vitexp.training.build import build_model
    from vitexp.training.modules import module_for

    try:
        cfg = _config(method, backbone)
    except vconfig.ConfigError as err:
        pytest.skip(f"method {method} does not accept {backbone}: {err}")
    torch.manual_seed(0)
    model, built, _ = build_model(cfg)
    size, classes = int(cfg.backbone.img_size), int(cfg.data.num_classes)
    x, y = torch.randn(2, 3, size, size), torch.tensor([0, 1])
    for stage in built.stages(model):
        module = module_for(stage.objective)(
            stage.model(), num_classes=classes, recipe=cfg.recipe, **dict(stage.module_kwargs)
        ).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _stage_loss(module, x, y)
        assert torch.isfinite(loss), f"{stage.name}: loss {loss}"
        if not any(
            p.requires_grad for p in module.parameters()
        ):  # method=knn: a frozen backbone, nothing to train
            continue
        loss.backward()
        grads = [p.grad for p in module.parameters() if p.requires_grad and p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), f"{stage.name}: gradients"
        assert any(g.abs().sum() > 0 for g in grads), f"{stage.name}: no gradient"


def test_bf16_mixed_trainer_fits_bspf():
    """The Lightning path the GPU configs take (``precision: bf16-mixed``), one step on the CPU."""
    import lightning as L

    from vitexp.training.build import build_model
    from vitexp.training.modules import ClassifyModule

    cfg = _config("bspf", "vit_micro")
    model, _, _ = build_model(cfg)
    data = torch.utils.data.TensorDataset(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    trainer = L.Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        fast_dev_run=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        ClassifyModule(model, 10, cfg.recipe),
        train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4),
    )
    assert trainer.global_step == 1 and torch.isfinite(trainer.callback_metrics["train/loss"])


def test_bf16_inference_bspf_deit_small_at_full_size():
    from vitexp.training.build import build_model

    cfg = vconfig.compose(["experiment=bspf_deit_small"])
    model, _, _ = build_model(cfg)
    model.eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        reference = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    # bf16 only perturbs the logits (the keep decisions are made in float32)
    assert float((out.float() - reference).abs().max()) < 0.1 * float(reference.abs().max())
