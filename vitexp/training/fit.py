"""The fits of one run: model (backbone + method) -> data -> LightningModule -> Trainer, stage by stage ->
test -> FLOPs and throughput of the deployed model. :func:`vitexp.runs.owner.owned_run` owns the run
around it (ledger entry, logger, resume, closing JSON line); :mod:`vitexp.training.build` builds the
objects.

Its reasoning: docs/commands.md, "vitexp/training/fit.py".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable

import lightning as L
import torch.nn as nn
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig

from vitexp.config.composition import to_container
from vitexp.data.datamodules import DATA_ORDER
from vitexp.ledger import atomic_write, portable_path, sha256
from vitexp.methods import Method, Stage
from vitexp.runs.callbacks import BestValidation, DataOrderMark, Heartbeat, LastValidation, ResumedFrom
from vitexp.runs.loggers import stage_keys
from vitexp.runs.owner import owned_run, resume_checkpoint
from vitexp.training.build import (
    build_backbone_and_method,
    build_datamodule,
    build_trainer,
    checkpoint_dir,
    pretrained_artifacts,
)
from vitexp.training.objectives import Objective, objective_for
from vitexp.training.resolve import Resolved


def stage_config(cfg: DictConfig, stage: Stage) -> DictConfig:
    """The stage's config: the run's with the stage's recipe keys (``Stage.recipe``) merged over its
    ``recipe`` (the data's batch size follows the recipe's). The one place a stage's recipe is
    derived: its Trainer, its LightningModule and its data are built from this config."""
    if not stage.recipe:
        return cfg
    from omegaconf import OmegaConf, open_dict

    out = cfg.copy()
    with open_dict(out):
        out.recipe = OmegaConf.merge(OmegaConf.to_container(cfg.recipe, resolve=True), dict(stage.recipe))
    return out


def stage_module(cfg: DictConfig, stage: Stage, model: nn.Module | None = None) -> L.LightningModule:
    """The stage's LightningModule (its objective's, :meth:`~vitexp.training.objectives.Objective.module`)
    around ``model`` (default: the stage's own), built from the stage's config."""
    return objective_for(cfg).module(stage_config(cfg, stage), stage, model)


def evaluate_stage(
    objective: Objective,
    trainer: L.Trainer,
    module: L.LightningModule,
    method: Method,
    stage: Stage,
    datamodule,
    prefix: str = "",
) -> dict[str, Any]:
    """The stage's test metrics (:meth:`~vitexp.training.objectives.Objective.test`), measured on the model
    as deployed (``Method.deploy``: SAPER's physically pruned heads); ``module.model`` becomes the
    deployed model. A stage with a ``soft_prefix`` first tests the model it trained (SAPER's soft
    gates) as ``<soft_prefix>top1`` ...."""
    metrics: dict[str, Any] = {}
    if stage.soft_prefix is not None:
        soft = objective.test(trainer, module, datamodule, prefix)
        metrics = {
            f"{stage.soft_prefix}{k[len(prefix) :]}": v for k, v in soft.items()
        }  # soft_top1, soft_top5, ...
    module.model = method.deploy(module.model)
    # a deployed k-NN model has no distillation target: its test_loss is None (the soft model's is
    # soft_test_loss)
    return {**metrics, **objective.test(trainer, module, datamodule, prefix)}


def fit_stage(
    objective: Objective,
    cfg: DictConfig,
    stage: Stage,
    datamodule_for,
    logger,
    output_dir: Path,
    callbacks,
    first: bool,
    entry: Any = None,
) -> tuple[L.LightningModule, L.Trainer, float, DictConfig, dict[str, float]]:
    """Fit ``stage``: its module, its Trainer, the seconds the fit took, the stage's config, and the
    ``val/*`` metrics of its last validation (restored with a stage whose checkpoint is past its last
    epoch, which validates nothing again: :class:`~vitexp.runs.callbacks.LastValidation`). A fit that
    restores a checkpoint records it in the run's ledger ``entry``
    (:class:`~vitexp.runs.callbacks.ResumedFrom`).
    """
    scfg = stage_config(cfg, stage)
    module = objective.module(scfg, stage)
    fits = (
        int(scfg.recipe.epochs) > 0
    )  # a zero-epoch stage (method=knn) is only tested: DDP cannot wrap a frozen model
    ckpt = (
        resume_checkpoint(cfg.resume, checkpoint_dir(output_dir, stage.name) / "last.ckpt", first)
        if fits
        else None
    )
    last = LastValidation()
    best = [
        BestValidation(f"val/{objective.headline[0]}"),
        last,
    ]  # the objective's headline metric on validation
    trainer = build_trainer(
        scfg, logger, output_dir, [*callbacks, *best, ResumedFrom(entry, stage.name, ckpt)], stage=stage.name
    )
    start = time.perf_counter()
    if fits:
        datamodule = datamodule_for(scfg)
        if (
            stage.best_val and ckpt is None
        ):  # the evaluation before the first epoch (RAPTOR's probes count it)
            trainer.validate(module, datamodule=datamodule, verbose=False)
        datamodule.train_augment = stage.augment
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
        finally:
            datamodule.train_augment = True
    return module, trainer, time.perf_counter() - start, scfg, last.metrics


def compile_protocol(cfg: DictConfig) -> dict[str, Any]:
    """``{"compile": ...}`` for the ledger's protocol of a run that compiled its model (the mode,
    fullgraph, backend, torch version: :meth:`vitexp.models.compiled.CompileOptions.record`); ``{}``
    for an eager run."""
    from vitexp.models.compiled import CompileOptions

    options = CompileOptions.of(cfg.get("compile"))
    return {"compile": options.record()} if options.enabled else {}


def datamodule_cache(data_config: dict[str, Any]) -> Callable[[DictConfig], L.LightningDataModule]:
    """One datamodule per batch size (stages may change the recipe's)."""
    datamodules: dict[int, L.LightningDataModule] = {}

    def datamodule_for(scfg: DictConfig) -> L.LightningDataModule:
        batch = int(scfg.recipe.batch_size)
        if batch not in datamodules:
            datamodules[batch] = build_datamodule(scfg, data_config)
        return datamodules[batch]

    return datamodule_for


def fit_run(
    resolved: Resolved,
    callbacks: Iterable[Callback] = (),
    kind: str = "train",
    measured: Callable[[], tuple[dict[str, Any], dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Train, test and record one run from its resolved parts (:func:`vitexp.training.resolve.resolve`,
    which checked the config: nothing here checks it again). Raises on failure after marking the
    ledger entry failed. ``kind``: the ledger kind (``rehearsal``: :mod:`vitexp.commands.rehearse`,
    whose ``measured`` adds its (metrics, protocol) to the entry on rank zero)."""
    import torch

    cfg = resolved.cfg
    started = time.perf_counter()
    output_dir = Path(cfg.output_dir)
    with owned_run(
        cfg.name, kind, cfg.results_dir, output_dir, cfg.logger, cfg.get("resume", False), resumable=True
    ) as run:
        run.start(to_container(cfg))
        L.seed_everything(int(cfg.seed), workers=True, verbose=False)
        backbone, method, data_config = build_backbone_and_method(cfg, resolved.method, resolved.weights)
        datamodule_for = datamodule_cache(data_config)
        method.prepare(backbone, datamodule_for(cfg))
        model = method.apply(backbone, cfg.budget)
        objective = resolved.objective
        stages = objective.stages(cfg, method, model, data_config)
        metrics: dict[str, Any] = {"epochs": 0, "steps": 0}
        deployed_model = model
        evaluated: dict[
            str, Any
        ] = {}  # what the stages' tests measured besides metrics (the k-NN bank), for the protocol
        order = DataOrderMark(DATA_ORDER)
        for i, stage in enumerate(stages):
            stage_keys(run.logger, stage.metrics_prefix)
            module, trainer, fit_s, scfg, val = fit_stage(
                objective,
                cfg,
                stage,
                datamodule_for,
                run.logger,
                output_dir,
                [*callbacks, Heartbeat(run.ledger, stage.name), order],
                i == 0,
                run.ledger,
            )
            if run.ledger is not None:
                run.ledger.fitting(stage.name, fit_s)
            metrics["epochs"] += trainer.current_epoch
            metrics["steps"] += trainer.global_step
            metrics[f"{stage.name}_fit_time_s" if stage.name != "main" else "fit_time_s"] = fit_s
            if stage.metrics_prefix is not None:
                p = stage.metrics_prefix
                metrics.update(
                    evaluate_stage(objective, trainer, module, method, stage, datamodule_for(scfg), p)
                )
                evaluated.update({f"{p}{k}": v for k, v in module.evaluation_protocol().items()})
                # validation saw the model the stage trained (the soft model when there is one)
                metrics.update(objective.validation_metrics(val, stage.soft_prefix or p))
                best = [c for c in trainer.callbacks if isinstance(c, BestValidation) and c.best is not None]
                # the best validation headline (top-1) of the model the stage trained, and its epoch
                if best:
                    metrics[f"{stage.soft_prefix or p}best_val_{objective.headline[0]}"] = (
                        100.0 * best[0].best
                    )
                    metrics[f"{stage.soft_prefix or p}best_val_epoch"] = best[0].best_epoch
            elif "val/loss" in val:
                metrics[f"{stage.name}_val_loss"] = val["val/loss"]
            if stage.deployed:
                deployed_model = module.model
            metrics["world_size"] = trainer.world_size
        stage_keys(run.logger, None)
        for stage_name, seconds in (run.ledger.previous_fit_time() if run.ledger is not None else {}).items():
            key = (
                "fit_time_s" if stage_name == "main" else f"{stage_name}_fit_time_s"
            )  # a resumed run: every attempt's
            metrics[key] = metrics.get(key, 0.0) + seconds
        if "fit_time_s" not in metrics:
            metrics["fit_time_s"] = sum(v for k, v in metrics.items() if k.endswith("_fit_time_s"))
        metrics.update(method.extra_metrics(metrics))
        if run.rank_zero:
            output_dir.mkdir(parents=True, exist_ok=True)  # a run without a fit has written nothing there yet
            weights = atomic_write(
                output_dir / "weights.pth", lambda tmp: torch.save(deployed_model.state_dict(), tmp)
            )
            deployed_metrics, protocol = objective.deployed_cost(cfg, method.deploy(deployed_model))
            protocol.update({**order.protocol(), **evaluated, **compile_protocol(cfg)})
            metrics.update(deployed_metrics)
            # a resumed run: every attempt's, as fit_time_s (vitexp.ledger.LedgerEntry.previous_wall_time)
            metrics["wall_time_s"] = time.perf_counter() - started + run.ledger.previous_wall_time()
            if measured is not None:
                extra_metrics, extra_protocol = measured()
                metrics.update(extra_metrics)
                protocol.update(extra_protocol)
            run.complete(
                metrics,
                protocol,
                step=metrics["steps"],
                artifacts={
                    "weights": portable_path(weights, cfg.results_dir),
                    "weights_sha256": sha256(weights),
                    **pretrained_artifacts(backbone, cfg.results_dir),
                },
                **method.record(),
            )
        else:
            run.complete(metrics)
    return run.result
