"""One run, end to end: config -> model (backbone + method) -> data -> LightningModule ->
Trainer -> test -> FLOPs and throughput of the deployed model -> ledger and logger.

``train(cfg)`` returns ``{"metrics": ..., "ledger": path, "run_id": ...}``. Accuracies in the
ledger are percentages. The test split is evaluated with the final weights (no checkpoint
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

from vitexp.config import to_container, validate
from vitexp.methods import Method, method_from_config
from vitexp.models import build_backbone
from vitexp.results import LedgerEntry


def is_rank_zero() -> bool:
    """Rank 0 of a (possibly distributed) job: the process that owns the ledger."""
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var]) == 0
    return True


def build_model(cfg: DictConfig) -> tuple[nn.Module, Method, dict[str, Any]]:
    """The backbone with the method applied, the method, and the model's data config
    (timm's ``resolve_data_config``: input size, interpolation, mean, std, crop)."""
    from timm.data import resolve_data_config

    method = method_from_config(cfg.method)
    backbone = build_backbone(cfg.backbone, num_classes=int(cfg.data.num_classes))
    data_config = resolve_data_config({}, model=backbone)
    model = method.apply(backbone, cfg.budget)
    return model, method, data_config


def build_datamodule(cfg: DictConfig, data_config: dict[str, Any]) -> L.LightningDataModule:
    return instantiate(cfg.data, data_config=data_config, loader_seed=int(cfg.seed), _convert_="all")


def build_trainer(cfg: DictConfig, logger, output_dir: Path, callbacks: Iterable[Callback] = ()) -> L.Trainer:
    """``lightning.Trainer`` from the ``trainer`` group; checkpoints every epoch to
    ``<output_dir>/checkpoints/last.ckpt`` (what ``resume=true`` continues from)."""
    kwargs = {k: v for k, v in cfg.trainer.items() if v is not None}
    cbs: list[Callback] = [
        ModelCheckpoint(dirpath=str(output_dir / "checkpoints"), save_last=True, save_top_k=1,
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


def resume_checkpoint(cfg: DictConfig, output_dir: Path) -> str | None:
    if not cfg.resume:
        return None
    ckpt = output_dir / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise FileNotFoundError(
            f"resume=true but no checkpoint at {ckpt}: pass the interrupted run's folder as hydra.run.dir"
        )
    return str(ckpt)


def evaluate_deployed(cfg: DictConfig, method: Method, model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """FLOPs/params and throughput of the model as deployed; (metrics, protocol)."""
    from vitexp.bench import measure_throughput
    from vitexp.flops import count_heads, count_macs

    deployed = method.deploy(model)
    img_size = int(cfg.backbone.img_size)
    metrics: dict[str, Any] = {}
    protocol: dict[str, Any] = {"accuracy_unit": "%", "num_classes": int(cfg.data.num_classes)}
    if cfg.eval.flops:
        report = count_macs(deployed, img_size)
        metrics.update(report.metrics())
        protocol.update(report.protocol)
    metrics["heads"] = count_heads(deployed)
    if cfg.eval.throughput:
        tp = measure_throughput(deployed, int(cfg.eval.throughput_batch), img_size, iters=int(cfg.eval.throughput_iters))
        metrics["throughput"] = tp["throughput"]
        protocol["throughput"] = {k: v for k, v in tp.items() if k != "throughput"}
    return metrics, protocol


def train(cfg: DictConfig, callbacks: Iterable[Callback] = ()) -> dict[str, Any]:
    """Train, test and record one run. Raises on failure after marking the ledger entry failed."""
    from vitexp.logging_utils import build_logger, finish, log_final, wandb_url
    from vitexp.module import module_for

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
        model, method, data_config = build_model(cfg)
        datamodule = build_datamodule(cfg, data_config)
        module = module_for(method.objective)(model, num_classes=int(cfg.data.num_classes), recipe=cfg.recipe,
                                              **method.module_kwargs())
        logger = build_logger(cfg.logger, cfg.name, output_dir, config) if rank_zero else False
        trainer = build_trainer(cfg, logger, output_dir, callbacks)
        fit_start = time.perf_counter()
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_checkpoint(cfg, output_dir))
        fit_s = time.perf_counter() - fit_start
        val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        test = trainer.test(module, datamodule=datamodule, verbose=False)[0]
        metrics: dict[str, Any] = {
            "top1": 100.0 * test["test/top1"],
            "top5": 100.0 * test["test/top5"],
            "test_loss": test["test/loss"],
            "val_top1": 100.0 * val["val/top1"] if "val/top1" in val else None,
            "epochs": trainer.current_epoch,
            "steps": trainer.global_step,
            "fit_time_s": fit_s,
            "world_size": trainer.world_size,
        }
        result = {"metrics": metrics, "ledger": None, "run_id": None}
        if not rank_zero:
            return result
        deployed_metrics, protocol = evaluate_deployed(cfg, method, module.model)
        metrics.update(deployed_metrics)
        metrics["wall_time_s"] = time.perf_counter() - started
        log_final(logger, metrics, step=trainer.global_step)
        path = ledger.finish(metrics, protocol, wandb_url=wandb_url(logger), output_dir=str(output_dir))
        return {"metrics": metrics, "ledger": str(path), "run_id": ledger.run_id}
    except BaseException as err:
        failed = True
        if ledger is not None and ledger.record["status"] == "running":
            ledger.fail(err, output_dir=str(output_dir))
        raise
    finally:
        finish(logger, failed)
