"""One run, end to end: config -> model (backbone + method) -> data -> LightningModule ->
Trainer -> test -> FLOPs and throughput of the deployed model -> ledger and logger.

``train(cfg)`` returns ``{"metrics": ..., "ledger": path, "run_id": ...}``. Accuracies in the
ledger are percentages. A run is one or more stages (``Method.stages``: one fit for most methods;
RAPTOR's surrogate stages 1 and 2, then its probes), each with its own Trainer, checkpoints and
recipe keys; the trained model's weights are saved as ``<output_dir>/weights.pth`` (the ledger's
``artifacts.weights``, what ``backbone.pretrained=run:<experiment>`` loads). The test split is evaluated with the final weights (no checkpoint
selection on the test set). Under DDP every rank trains; torchmetrics syncs the accuracies across
ranks (Lightning's DistributedSampler pads an uneven split by at most world_size - 1 repeated
samples); only rank 0 writes the ledger, logs, counts FLOPs and times throughput.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable

import lightning as L
import torch.nn as nn
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig

from vitexp.callbacks import BestValidation
from vitexp.config import to_container, validate
from vitexp.methods import Method, Stage, method_from_config
from vitexp.models import build_backbone
from vitexp.results import LedgerEntry


def is_rank_zero() -> bool:
    """Rank 0 of a (possibly distributed) job: the process that owns the ledger."""
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var]) == 0
    return True


def build_configured_backbone(cfg: DictConfig) -> nn.Module:
    """The ``backbone`` group's model with the data's class count, its weights resolved by
    :func:`vitexp.results.resolve_weights` (a path, or ``run:<experiment>``)."""
    from vitexp.results import resolve_weights

    backbone_cfg = {**cfg.backbone, "pretrained": resolve_weights(cfg.backbone.get("pretrained"), cfg.results_dir)}
    return build_backbone(backbone_cfg, num_classes=int(cfg.data.num_classes))


def build_backbone_and_method(cfg: DictConfig) -> tuple[nn.Module, Method, dict[str, Any]]:
    """The backbone, the method, and the model's data config (:func:`data_config_for`)."""
    method = method_from_config(cfg.method)
    backbone = build_configured_backbone(cfg)
    return backbone, method, data_config_for(cfg, backbone)


def data_config_for(cfg: DictConfig, backbone: nn.Module) -> dict[str, Any]:
    """timm's data config of ``backbone`` at the configured resolution: ``input_size`` is
    ``backbone.img_size`` (timm's DINOv2 configs say 518 px whatever the model is built at) and
    ``backbone.crop_pct``, where set, replaces the pretrained config's crop (DINOv2 at 224 px:
    0.875, i.e. Resize 256 then CenterCrop 224 as RAPTOR and DINOv2's linear evaluation)."""
    from timm.data import resolve_data_config

    data_config = resolve_data_config({}, model=backbone)
    img = int(cfg.backbone.img_size)
    data_config["input_size"] = (3, img, img)
    if cfg.backbone.get("crop_pct"):
        data_config["crop_pct"] = float(cfg.backbone.crop_pct)
    return data_config


def build_model(cfg: DictConfig) -> tuple[nn.Module, Method, dict[str, Any]]:
    """The backbone with the method applied (no data seen: ``Method.prepare`` is skipped), the
    method, and the model's data config."""
    backbone, method, data_config = build_backbone_and_method(cfg)
    return method.apply(backbone, cfg.budget), method, data_config


def build_datamodule(cfg: DictConfig, data_config: dict[str, Any]) -> L.LightningDataModule:
    return instantiate(cfg.data, data_config=data_config, loader_seed=int(cfg.seed), _convert_="all")


def build_trainer(cfg: DictConfig, logger, output_dir: Path, callbacks: Iterable[Callback] = (),
                  stage: str = "main") -> L.Trainer:
    """``lightning.Trainer`` from the ``trainer`` group; checkpoints every epoch to
    ``<output_dir>/checkpoints[/<stage>]/last.ckpt`` (what ``resume=true`` continues from)."""
    kwargs = {k: v for k, v in cfg.trainer.items() if v is not None}
    cbs: list[Callback] = [
        ModelCheckpoint(dirpath=str(checkpoint_dir(output_dir, stage)), save_last=True, save_top_k=1,
                        save_on_train_epoch_end=True),
        *callbacks,
    ]
    if logger:
        cbs.append(LearningRateMonitor(logging_interval="epoch"))
    return L.Trainer(
        max_epochs=int(cfg.recipe.epochs),
        gradient_clip_val=cfg.recipe.grad_clip,
        default_root_dir=str(output_dir),
        logger=logger,
        callbacks=cbs,
        **kwargs,
    )


def checkpoint_dir(output_dir: Path, stage: str = "main") -> Path:
    return output_dir / "checkpoints" if stage == "main" else output_dir / "checkpoints" / stage


def resume_checkpoint(cfg: DictConfig, output_dir: Path, stage: str = "main", first: bool = True) -> str | None:
    """The stage's ``last.ckpt`` under ``resume=true``. The run's first stage must have one; a
    later stage without one starts fresh (the run was interrupted before it)."""
    if not cfg.resume:
        return None
    ckpt = checkpoint_dir(output_dir, stage) / "last.ckpt"
    if not ckpt.is_file():
        if not first:
            return None
        raise FileNotFoundError(
            f"resume=true but no checkpoint at {ckpt}: pass the interrupted run's folder as hydra.run.dir"
        )
    return str(ckpt)


def stage_config(cfg: DictConfig, stage: Stage) -> DictConfig:
    """The run's config with the stage's recipe keys (the data's batch size follows the recipe's)."""
    if not stage.recipe:
        return cfg
    from omegaconf import OmegaConf, open_dict

    out = cfg.copy()
    with open_dict(out):
        out.recipe = OmegaConf.merge(OmegaConf.to_container(cfg.recipe, resolve=True), dict(stage.recipe))
    return out


def registers_of(cfg: DictConfig) -> int:
    """Register tokens of the configured ViT (prefix tokens beyond CLS), for the FLOPs protocol."""
    return max(0, int(cfg.backbone.arch.num_prefix_tokens) - 1)


def evaluate_deployed(cfg: DictConfig, method: Method, model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """FLOPs/params and throughput of the model as deployed; (metrics, protocol)."""
    from vitexp.bench import bench_device, measure_throughput
    from vitexp.flops import count_heads, count_macs

    deployed = method.deploy(model)
    img_size = int(cfg.backbone.img_size)
    metrics: dict[str, Any] = {}
    protocol: dict[str, Any] = {"accuracy_unit": "%", "num_classes": int(cfg.data.num_classes)}
    if cfg.eval.flops:
        report = count_macs(deployed, img_size, registers=registers_of(cfg))
        metrics.update(report.metrics())
        protocol.update(report.protocol)
    metrics["heads"] = count_heads(deployed)
    if cfg.eval.throughput:  # on bench.device (the GPU when there is one: Lightning hands the model back on the CPU)
        deployed = deployed.to(bench_device(str(cfg.bench.device)))
        tp = measure_throughput(deployed, int(cfg.eval.throughput_batch), img_size, iters=int(cfg.eval.throughput_iters),
                                amp=bool(cfg.bench.amp))
        metrics["throughput"] = tp["throughput"]
        protocol["throughput"] = {k: v for k, v in tp.items() if k != "throughput"}
    return metrics, protocol


def teacher_probe_from_ledger(method: Method, cfg: DictConfig) -> dict[str, Any]:
    """``teacher_top1`` taken from a completed run named by ``method.teacher_probe_run`` (RAPTOR)."""
    from vitexp.results import completed_runs

    run_id = getattr(method, "teacher_probe_run", None)
    if not run_id:
        return {}
    runs = [r for r in completed_runs(kind="train", results_dir=cfg.results_dir) if run_id in (r["run_id"], r["experiment"])]
    if not runs:
        raise FileNotFoundError(f"method.teacher_probe_run={run_id}: no completed train run with that id or experiment "
                                f"in {Path(cfg.results_dir) / 'runs'}")
    run = runs[-1]
    for key in ("backbone", "data"):
        theirs, ours = run["config"].get(key, {}).get("name"), cfg[key].name
        if theirs != ours:
            raise ValueError(f"method.teacher_probe_run={run_id}: that run's {key} is {theirs}, this run's is {ours}")
    return {"teacher_top1": run["metrics"]["top1"], "teacher_top5": run["metrics"].get("top5"),
            "teacher_probe_run": run["run_id"]}


def fit_stage(cfg: DictConfig, stage: Stage, datamodule_for, logger, output_dir: Path, callbacks,
              first: bool) -> tuple[L.LightningModule, L.Trainer, float]:
    from vitexp.module import module_for

    scfg = stage_config(cfg, stage)
    module = module_for(stage.objective)(stage.model(), num_classes=int(cfg.data.num_classes), recipe=scfg.recipe,
                                         **dict(stage.module_kwargs))
    best = [BestValidation("val/top1")] if stage.best_val else []
    trainer = build_trainer(scfg, logger, output_dir, [*callbacks, *best], stage=stage.name)
    start = time.perf_counter()
    if best:  # the evaluation before the first epoch (RAPTOR's probes count it)
        trainer.validate(module, datamodule=datamodule_for(scfg), verbose=False)
    trainer.fit(module, datamodule=datamodule_for(scfg),
                ckpt_path=resume_checkpoint(cfg, output_dir, stage.name, first=first))
    return module, trainer, time.perf_counter() - start


def train(cfg: DictConfig, callbacks: Iterable[Callback] = ()) -> dict[str, Any]:
    """Train, test and record one run. Raises on failure after marking the ledger entry failed."""
    import torch

    from vitexp.logging_utils import build_logger, finish, log_final, wandb_url

    validate(cfg)
    started = time.perf_counter()
    output_dir = Path(cfg.output_dir)
    config = to_container(cfg)
    rank_zero = is_rank_zero()
    ledger = LedgerEntry(cfg.name, "train", config, cfg.results_dir).start() if rank_zero else None
    logger = None
    failed = False
    try:
        L.seed_everything(int(cfg.seed), workers=True, verbose=False)
        backbone, method, data_config = build_backbone_and_method(cfg)
        datamodules: dict[int, L.LightningDataModule] = {}

        def datamodule_for(scfg: DictConfig) -> L.LightningDataModule:
            batch = int(scfg.recipe.batch_size)
            if batch not in datamodules:
                datamodules[batch] = build_datamodule(scfg, data_config)
            return datamodules[batch]

        teacher_metrics = teacher_probe_from_ledger(method, cfg)  # before training: a wrong id fails now
        method.prepare(backbone, datamodule_for(cfg))
        model = method.apply(backbone, cfg.budget)
        logger = build_logger(cfg.logger, cfg.name, output_dir, config) if rank_zero else False
        metrics: dict[str, Any] = {"epochs": 0, "steps": 0}
        deployed_model = model
        for i, stage in enumerate(method.stages(model)):
            module, trainer, fit_s = fit_stage(cfg, stage, datamodule_for, logger, output_dir, callbacks, i == 0)
            metrics["epochs"] += trainer.current_epoch
            metrics["steps"] += trainer.global_step
            metrics[f"{stage.name}_fit_time_s" if stage.name != "main" else "fit_time_s"] = fit_s
            if stage.metrics_prefix is not None:
                p = stage.metrics_prefix
                val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
                test = trainer.test(module, datamodule=datamodule_for(stage_config(cfg, stage)), verbose=False)[0]
                metrics.update({
                    f"{p}top1": 100.0 * test["test/top1"],
                    f"{p}top5": 100.0 * test["test/top5"],
                    f"{p}test_loss": test["test/loss"],
                    f"{p}val_top1": 100.0 * val["val/top1"] if "val/top1" in val else None,
                })
                best = [c.best for c in trainer.callbacks if isinstance(c, BestValidation) and c.best is not None]
                if best:
                    metrics[f"{p}best_val_top1"] = 100.0 * best[0]
            elif "val/loss" in trainer.callback_metrics:
                metrics[f"{stage.name}_val_loss"] = float(trainer.callback_metrics["val/loss"])
            if stage.deployed:
                deployed_model = module.model
            metrics["world_size"] = trainer.world_size
        if "fit_time_s" not in metrics:
            metrics["fit_time_s"] = sum(v for k, v in metrics.items() if k.endswith("_fit_time_s"))
        metrics.update(teacher_metrics)
        if metrics.get("teacher_top1") and metrics.get("top1") is not None:
            metrics["recovered"] = metrics["top1"] / metrics["teacher_top1"]
        result = {"metrics": metrics, "ledger": None, "run_id": None}
        if not rank_zero:
            return result
        weights = output_dir / "weights.pth"
        torch.save(deployed_model.state_dict(), weights)
        deployed_metrics, protocol = evaluate_deployed(cfg, method, deployed_model)
        metrics.update(deployed_metrics)
        metrics["wall_time_s"] = time.perf_counter() - started
        log_final(logger, metrics, step=metrics["steps"])
        path = ledger.finish(metrics, protocol, wandb_url=wandb_url(logger), output_dir=str(output_dir),
                             artifacts={"weights": str(weights)}, **method.record())
        return {"metrics": metrics, "ledger": str(path), "run_id": ledger.run_id}
    except BaseException as err:
        failed = True
        if ledger is not None and ledger.record["status"] == "running":
            ledger.fail(err, output_dir=str(output_dir))
        raise
    finally:
        finish(logger, failed)
