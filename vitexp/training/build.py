"""Config -> objects: the backbone, the method, the model, the datamodule, the Trainer. Nothing
here trains; :mod:`vitexp.training.fit` runs the fits and :mod:`vitexp.runs.owner` owns the run around them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import lightning as L
import torch.nn as nn
from hydra.utils import instantiate
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from omegaconf import DictConfig

from vitexp.methods import Method, method_from_config
from vitexp.models import build_backbone
from vitexp.runs import slurm


def load_weights(path: str | Path) -> dict[str, Any]:
    """A state dict from ``weights.pth`` or from a vitexp Lightning checkpoint (its ``state_dict``,
    the LightningModule's ``model.`` prefix removed)."""
    import torch

    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "pytorch-lightning_version" in state:
        state = {k[len("model.") :]: v for k, v in state["state_dict"].items() if k.startswith("model.")}
    return state


#: ``weights`` not given: the builder resolves ``backbone.pretrained`` itself.
UNRESOLVED: Any = object()


def build_configured_backbone(cfg: DictConfig, weights: Any = UNRESOLVED) -> nn.Module:
    """The ``backbone`` group's model with the data's class count, loaded with ``weights``: the file a
    run's resolve step found (:class:`vitexp.training.resolve.Resolved`), else the one
    :func:`vitexp.config.weights.resolve_weights` finds for ``backbone.pretrained`` (a tool building a
    model from a config alone). A vitexp Lightning checkpoint (``checkpoints/last.ckpt``) loads
    through :func:`load_weights`."""
    from vitexp.config.weights import resolve_weights
    from vitexp.models import CheckpointMismatchError

    if weights is UNRESOLVED:
        weights = resolve_weights(cfg.backbone.get("pretrained"), cfg.results_dir)
    lightning_ckpt = bool(weights) and str(weights).endswith(".ckpt")
    backbone_cfg = {**cfg.backbone, "pretrained": None if lightning_ckpt else weights}
    model = build_backbone(backbone_cfg, num_classes=int(cfg.data.num_classes))
    if lightning_ckpt:
        from vitexp.models.factory import LoadedWeights

        missing, unexpected = model.load_state_dict(
            load_weights(Path(str(weights)).expanduser()), strict=False
        )
        if missing or unexpected:
            raise CheckpointMismatchError(
                str(weights), list(missing), list(unexpected), "the backbone's own keys"
            )
        model.pretrained_weights = LoadedWeights(str(weights), "state_dict", "a vitexp Lightning checkpoint")
    return model


def pretrained_artifacts(backbone: nn.Module, results_dir: Path | str) -> dict[str, Any]:
    """``{"pretrained": ...}`` for the ledger's ``artifacts`` of a run whose backbone loaded a file
    (``backbone.pretrained_weights``, :class:`vitexp.models.factory.LoadedWeights`): the file
    (portable), its sha256, the set loaded (``state_dict``, ``state_dict_ema``, ``model``,
    ``model_ema``, or ``plain`` for a file that is the state dict) and what chose that set (the
    reference evaluation's file and line, or the ``backbone.use_ema`` override); ``{}`` without a file."""
    from vitexp.ledger import portable_path, sha256

    loaded = getattr(backbone, "pretrained_weights", None)
    if loaded is None:
        return {}
    return {
        "pretrained": {
            "file": portable_path(loaded.path, results_dir),
            "sha256": sha256(loaded.path),
            "weights": loaded.weights,
            "chosen_by": loaded.chosen_by,
        }
    }


def build_backbone_and_method(
    cfg: DictConfig, method: Method | None = None, weights: Any = UNRESOLVED
) -> tuple[nn.Module, Method, dict[str, Any]]:
    """The backbone (with ``weights``: :func:`build_configured_backbone`), the method (``method`` when
    the caller built it already), and the model's data config."""
    method = method or method_from_config(cfg.method)
    backbone = build_configured_backbone(cfg, weights)
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


def build_model(
    cfg: DictConfig, method: Method | None = None, weights: Any = UNRESOLVED
) -> tuple[nn.Module, Method, dict[str, Any]]:
    """The backbone with the method applied (no data seen: ``Method.prepare`` is skipped), the
    method, and the model's data config."""
    backbone, method, data_config = build_backbone_and_method(cfg, method, weights)
    return method.apply(backbone, cfg.budget), method, data_config


def build_datamodule(cfg: DictConfig, data_config: dict[str, Any]) -> L.LightningDataModule:
    return instantiate(cfg.data, data_config=data_config, loader_seed=int(cfg.seed), _convert_="all")


def registers_of(cfg: DictConfig) -> int:
    """Register tokens of the configured ViT (prefix tokens beyond CLS), for the FLOPs protocol."""
    return max(0, int(cfg.backbone.arch.num_prefix_tokens) - 1)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoints written through :func:`vitexp.ledger.atomic_write`: a job
    killed while saving keeps the previous ``last.ckpt`` whole (what ``resume=auto`` continues from)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        from vitexp.ledger import atomic_write

        atomic_write(
            path,
            lambda tmp: super(AtomicCheckpointIO, self).save_checkpoint(checkpoint, tmp, storage_options),
        )


class PercentProgressBar(TQDMProgressBar):
    """Lightning's bar with accuracies (``val/top1`` ..., :func:`vitexp.runs.loggers.logged_fraction`)
    shown in % as the ledger records them."""

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        from vitexp.runs.loggers import logged_fraction

        items = super().get_metrics(trainer, pl_module)
        return {
            k: f"{100 * float(v):.2f}%" if logged_fraction(k) and isinstance(v, (int, float)) else v
            for k, v in items.items()
        }


def checkpoint_dir(output_dir: Path, stage: str = "main") -> Path:
    return output_dir / "checkpoints" if stage == "main" else output_dir / "checkpoints" / stage


def build_trainer(
    cfg: DictConfig,
    logger,
    output_dir: Path,
    callbacks: Iterable[Callback] = (),
    stage: str = "main",
    test_only: bool = False,
) -> L.Trainer:
    """``lightning.Trainer`` from the ``trainer`` group. One checkpoint file per stage,
    ``<output_dir>/checkpoints[/<stage>]/last.ckpt``, replaced at every epoch's end (the newest
    only: ``save_top_k=1`` without a monitored metric; no second copy). ``test_only`` (``vitexp-eval``):
    one process on one device, no checkpoint, no SLURM requeue."""
    kwargs = {k: v for k, v in cfg.trainer.items() if v is not None}
    cbs: list[Callback] = list(callbacks)
    plugins: list = []
    if test_only:
        kwargs.update(
            devices=1, num_nodes=1, strategy="auto", enable_checkpointing=False, enable_model_summary=False
        )
    else:
        cbs.insert(
            0,
            ModelCheckpoint(
                dirpath=str(checkpoint_dir(output_dir, stage)),
                filename="last",
                save_top_k=1,
                save_last=False,
                enable_version_counter=False,
                save_on_train_epoch_end=True,
            ),
        )
        plugins = [AtomicCheckpointIO(), *slurm.plugins()]
    if logger:
        cbs.append(LearningRateMonitor(logging_interval="epoch"))
    if kwargs.get("enable_progress_bar", True):
        cbs.append(PercentProgressBar())
    return L.Trainer(
        max_epochs=int(cfg.recipe.epochs),
        gradient_clip_val=cfg.recipe.grad_clip,
        default_root_dir=str(output_dir),
        logger=logger,
        callbacks=cbs,
        plugins=plugins,
        **kwargs,
    )
