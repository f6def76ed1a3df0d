"""LightningModules, one per objective. A module trains whatever ``nn.Module`` it is given and never knows
which method produced it.

Its reasoning: docs/commands.md, "vitexp/training/modules.py".
"""

from __future__ import annotations

import random
from typing import Any, Mapping

import lightning as L
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from vitexp.errors import NonFiniteLossError
from vitexp.models.compiled import CompileOptions


class ObjectiveModule(L.LightningModule):
    """What every objective shares: the model, the recipe's optimizer and scheduler (timm, stepped
    per optimisation step; ``recipe.lr`` × global batch / ``recipe.lr_base_batch`` when the latter
    is set, DeiT's rule), the global RNG states saved with each checkpoint (exact resume), the
    training progress told to models that anneal (``set_progress``), and the finite-loss guard."""

    def __init__(self, model: nn.Module, num_classes: int, recipe: Mapping[str, Any]):
        super().__init__()
        self.model = model
        self.num_classes = int(num_classes)
        self.recipe = dict(recipe)
        self.compile_options: CompileOptions | None = None
        self._compiled: dict[tuple[int, str], Any] = {}  # (id of the model, entry) -> compiled call

    def set_compile(self, options: CompileOptions | None) -> None:
        """Compile the model's entries (:meth:`compiled`) with ``options`` (the config's ``compile``
        block, :mod:`vitexp.models.compiled`); ``None`` or not enabled: eager."""
        self.compile_options = options if options is not None and options.enabled else None
        self._compiled = {}

    def compiled(self, entry: str = "forward"):
        """``self.model``'s ``entry`` (``forward``: the model itself; ``distill_targets``,
        ``stage_loss``: the objectives' own), compiled once per model when the run compiles
        (a deployed model, which replaces ``self.model`` before the test, gets its own)."""
        call = self.model if entry == "forward" else getattr(self.model, entry)
        if self.compile_options is None:
            return call
        key = (id(self.model), entry)
        if key not in self._compiled:
            from vitexp.models.compiled import compile_call

            self._compiled = {k: v for k, v in self._compiled.items() if k[0] == id(self.model)}
            self._compiled[key] = compile_call(call, self.compile_options)
        return self._compiled[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compiled()(x)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """Models with a training schedule of their own (SAPER's annealed head budget) expose
        ``set_progress(fraction)``; the module tells them how far training is, nothing more."""
        if hasattr(self.model, "set_progress"):
            total = max(1, int(self.trainer.estimated_stepping_batches))
            self.model.set_progress(min(1.0, self.global_step / total))

    def evaluation_protocol(self) -> dict[str, Any]:
        """What the last test measured besides its metrics, for the run's ledger ``protocol`` (the
        k-NN memory bank: :meth:`DistillModule.evaluation_protocol`). Default: nothing."""
        return {}

    def check_finite(self, loss: torch.Tensor, what: str = "training loss") -> torch.Tensor:
        """``loss``, or :class:`NonFiniteLossError` naming where it stopped and what to change."""
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"{what} is {loss.item()} at epoch {self.current_epoch}, step {self.global_step}: "
                "stopping (lower recipe.lr, set recipe.grad_clip, or check the data)"
            )
        return loss

    # -- optimisation --------------------------------------------------------------------------
    def effective_lr(self) -> float:
        lr = float(self.recipe["lr"])
        base = self.recipe.get("lr_base_batch")
        if base:
            world = self.trainer.world_size if self._trainer is not None else 1
            lr *= int(self.recipe["batch_size"]) * world / float(base)
        return lr

    def configure_optimizers(self):
        steps = max(1, int(self.trainer.estimated_stepping_batches))
        optimizer, scheduler = build_optimizer(self.model, self.recipe, self.effective_lr(), steps)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric) -> None:
        scheduler.step_update(num_updates=self.global_step)

    # -- exact resume: the global RNGs (augmentation, mixup, drop path) travel with checkpoints --
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        checkpoint["vitexp_rng"] = {  # plain types and tensors only: loadable with weights_only=True
            "torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "python": random.getstate(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("vitexp_rng")
        if state:
            torch.set_rng_state(state["torch"])
            kind, keys, pos, has_gauss, gauss = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
            random.setstate(state["python"])


class ClassifyModule(ObjectiveModule):
    """Supervised classification of ``model``'s logits.

    ``recipe`` holds the optimisation keys of ``conf/recipe/*.yaml`` (:class:`ObjectiveModule`);
    Mixup/CutMix from ``recipe.mixup``/``recipe.cutmix``; top-1/top-5 by torchmetrics.
    """

    def __init__(self, model: nn.Module, num_classes: int, recipe: Mapping[str, Any]):
        super().__init__(model, num_classes, recipe)
        self.mixup_fn = None
        if float(self.recipe.get("mixup", 0)) > 0 or float(self.recipe.get("cutmix", 0)) > 0:
            from timm.data import Mixup

            self.mixup_fn = Mixup(
                mixup_alpha=float(self.recipe["mixup"]),
                cutmix_alpha=float(self.recipe["cutmix"]),
                label_smoothing=float(self.recipe.get("label_smoothing", 0.0)),
                num_classes=self.num_classes,
            )
        top_k = min(5, self.num_classes)
        for split in ("val", "test"):
            setattr(
                self,
                f"{split}_top1",
                MulticlassAccuracy(num_classes=self.num_classes, top_k=1, average="micro"),
            )
            setattr(
                self,
                f"{split}_top5",
                MulticlassAccuracy(num_classes=self.num_classes, top_k=top_k, average="micro"),
            )
            setattr(self, f"{split}_loss", MeanMetric())

    def on_fit_start(self) -> None:
        """Reset the evaluation metrics outside inference mode: a test or validation before this fit (a
        resumed stage, a second fit of the module) resets their states under inference mode, and fit's
        validation, which runs under ``no_grad`` only, cannot update an inference tensor in place."""
        for split in ("val", "test"):
            for kind in ("top1", "top5", "loss"):
                getattr(self, f"{split}_{kind}").reset()

    def log_eval_loss(self, split: str, loss: torch.Tensor, images: int, **kwargs: Any) -> None:
        """``<split>/loss``: the mean over every image of the split, on all ranks together (module docstring);
        ``loss`` is the batch's mean over its ``images``."""
        metric = getattr(self, f"{split}_loss")
        metric.update(loss.detach().float(), weight=images)
        self.log(f"{split}/loss", metric, on_step=False, on_epoch=True, **kwargs)

    # -- steps ---------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.mixup_fn is not None and len(x) % 2 == 0:
            x, soft = self.mixup_fn(x, y)
            loss = torch.sum(-soft * F.log_softmax(self(x), dim=-1), dim=-1).mean()
        else:
            loss = F.cross_entropy(self(x), y, label_smoothing=float(self.recipe.get("label_smoothing", 0.0)))
        self.check_finite(loss)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"], prog_bar=False, on_step=True, on_epoch=False)
        return loss

    def _eval_step(self, batch, split: str) -> None:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        top1, top5 = getattr(self, f"{split}_top1"), getattr(self, f"{split}_top5")
        top1.update(logits, y)
        top5.update(logits, y)
        self.log_eval_loss(split, loss, len(y), prog_bar=split == "val")
        self.log(f"{split}/top1", top1, prog_bar=True, on_epoch=True)
        self.log(f"{split}/top5", top5, on_epoch=True)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, "test")


def build_optimizer(model: nn.Module, recipe: Mapping[str, Any], lr: float, total_steps: int):
    """timm's optimizer (no weight decay on norms, biases and ``model.no_weight_decay()``) and
    timm's scheduler (warm-up then ``recipe.sched``), stepped per optimisation step. With
    ``recipe.warmup_steps`` the warm-up is that many steps (capped below the run's length)."""
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    optimizer = create_optimizer_v2(
        model, opt=recipe["opt"], lr=lr, weight_decay=float(recipe["weight_decay"])
    )
    if recipe.get("sched", "cosine") == "none":
        return optimizer, None
    if recipe.get("warmup_steps"):  # a warm-up counted in steps (RAPTOR's 10k): the schedule runs in steps
        scheduler, _ = create_scheduler_v2(
            optimizer,
            sched=recipe["sched"],
            num_epochs=total_steps,
            warmup_epochs=min(int(recipe["warmup_steps"]), max(0, total_steps - 1)),
            warmup_lr=float(recipe["warmup_lr"]),
            min_lr=float(recipe["min_lr"]),
            step_on_epochs=False,
            updates_per_epoch=1,
        )
        return optimizer, scheduler
    epochs = int(recipe["epochs"])
    scheduler, _ = create_scheduler_v2(
        optimizer,
        sched=recipe["sched"],
        num_epochs=epochs,
        warmup_epochs=int(recipe["warmup_epochs"]),
        warmup_lr=float(recipe["warmup_lr"]),
        min_lr=float(recipe["min_lr"]),
        step_on_epochs=False,
        updates_per_epoch=max(1, total_steps // epochs),
    )
    return optimizer, scheduler


def weighted_knn_votes(
    features: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
) -> torch.Tensor:
    """DINO's weighted k-NN classifier: cosine similarities to the k nearest bank features,
    weights exp(sim / T), summed per class. Returns (N, classes) votes (usable as logits)."""
    sims = F.normalize(features, dim=-1) @ F.normalize(bank, dim=-1).T
    top, idx = sims.topk(min(k, bank.shape[0]), dim=-1)
    weights = (top / temperature).exp()
    votes = torch.zeros(features.shape[0], num_classes, device=features.device, dtype=weights.dtype)
    return votes.scatter_add_(1, bank_labels[idx], weights)


def bank_summary(bank: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """A k-NN memory bank as the ledger's protocol records it (``knn_bank``): its ``size``, its images
    per label (``labels``) and the sum of its features' absolute values (``feature_abs_sum``, in float64).
    An image counted twice or left out changes the size; one swapped for another image changes the
    sum, and the label counts unless both have one label."""
    counts = torch.bincount(labels.detach().long().flatten().cpu())
    return {
        "size": int(bank.shape[0]),
        "labels": {str(c): int(n) for c, n in enumerate(counts.tolist()) if n},
        "feature_abs_sum": float(bank.detach().double().abs().sum()),
    }


class DistillModule(ClassifyModule):
    """Feature distillation with k-NN evaluation (SAPER).

    - Training: the model returns (student tokens, teacher tokens) from ``distill_targets(x)``;
      the loss is per-token MSE (or 1 − cosine) over CLS and patch tokens.
    - Evaluation: ``forward(x)`` gives the k-NN features, so a deployed model (no teacher, no
      ``distill_targets``) is evaluated the same way; the loss is logged only where the model has
      a teacher. A weighted k-NN classifier (:func:`weighted_knn_votes`) over the training split's
      features (evaluation transforms), recomputed at every validation and test (not in the
      sanity check). Accuracy logs as ``val/top1`` and ``test/top1`` like the classify objective.
    - Under DDP the memory bank is sharded: rank r encodes the contiguous shard r of the training
      split (``datamodule.train_eval_dataloader(rank, world_size)``, no padding), and the shards,
      of unequal sizes, are gathered in rank order, so the bank holds each image once, in the
      single-process order. The test's bank is recorded in the run's protocol (``knn_bank``:
      :func:`bank_summary`), so a run under DDP can be compared with one process's bank itself.
    - A model with nothing to train (``method=knn``) gets no optimizer.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        recipe: Mapping[str, Any],
        loss: str = "mse",
        knn_k: int = 20,
        knn_temperature: float = 0.07,
    ):
        if loss not in ("mse", "cosine"):
            raise ValueError(f"method.loss={loss!r}: valid losses are ('mse', 'cosine')")
        super().__init__(model, num_classes, {**recipe, "mixup": 0.0, "cutmix": 0.0})
        self.loss_kind, self.knn_k, self.knn_temperature = loss, int(knn_k), float(knn_temperature)
        self._eval_feats: list[torch.Tensor] = []
        self._eval_labels: list[torch.Tensor] = []
        self.knn_bank: dict[str, Any] | None = None

    def evaluation_protocol(self) -> dict[str, Any]:
        return {"knn_bank": self.knn_bank} if self.knn_bank is not None else {}

    def distill_loss(self, x: torch.Tensor) -> torch.Tensor:
        student, teacher = self.compiled("distill_targets")(x)
        if self.loss_kind == "mse":
            return F.mse_loss(student, teacher)
        return (1 - F.cosine_similarity(student, teacher, dim=-1)).mean()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.check_finite(self.distill_loss(batch[0]), "distillation loss")
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        if not any(p.requires_grad for p in self.model.parameters()):
            return None
        return super().configure_optimizers()

    def _eval_step(self, batch, split: str) -> None:
        x, y = batch
        self._eval_feats.append(self(x).detach())
        self._eval_labels.append(y)
        if hasattr(self.model, "distill_targets"):
            self.log_eval_loss(split, self.distill_loss(x), len(x))

    def gather_shards(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (n_r, ...), concatenated in rank order; the n_r may differ
        (``all_gather`` needs equal shapes: each shard is padded to the largest, then trimmed)."""
        if self.trainer.world_size == 1:
            return t
        sizes = self.all_gather(torch.tensor([t.shape[0]], device=t.device)).flatten().tolist()
        padded = t.new_zeros((max(sizes), *t.shape[1:]))
        padded[: t.shape[0]] = t
        gathered = self.all_gather(padded)
        return torch.cat([gathered[r, :n] for r, n in enumerate(sizes)])

    @torch.no_grad()
    def memory_bank(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training split's k-NN features and labels, each image encoded once across ranks."""
        loader = self.trainer.datamodule.train_eval_dataloader(self.global_rank, self.trainer.world_size)
        feats, labels = [], []
        from tqdm.auto import tqdm

        for xb, yb in tqdm(
            loader,
            desc="k-NN bank",
            unit="batch",
            leave=False,
            disable=not self.trainer.is_global_zero or None,
        ):
            feats.append(self(xb.to(self.device)))
            labels.append(yb.to(self.device))
        return self.gather_shards(torch.cat(feats)), self.gather_shards(torch.cat(labels))

    @torch.no_grad()
    def _knn_epoch_end(self, split: str) -> None:
        feats, labels = self._eval_feats, self._eval_labels
        self._eval_feats, self._eval_labels = [], []
        if not feats or self.trainer.sanity_checking:
            return
        feats, labels = torch.cat(feats), torch.cat(labels)
        bank, bank_labels = self.memory_bank()
        if split == "test":
            self.knn_bank = bank_summary(bank, bank_labels)
        votes = weighted_knn_votes(
            feats, bank, bank_labels, self.num_classes, self.knn_k, self.knn_temperature
        )
        top1, top5 = getattr(self, f"{split}_top1"), getattr(self, f"{split}_top5")
        top1.update(votes, labels)
        top5.update(votes, labels)
        self.log(f"{split}/top1", top1, prog_bar=True)
        self.log(f"{split}/top5", top5)

    def on_validation_epoch_end(self) -> None:
        self._knn_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._knn_epoch_end("test")


class RaptorStageModule(ClassifyModule):
    """One stage of RAPTOR's surrogate training: the model's ``stage_loss(x, stage, progress)``
    (the model's own) on the training images, labels unused. Validation logs the same
    stage's loss at the end of its schedule (stage 1: autoregressive, τ = 0) as ``val/loss``."""

    def __init__(self, model: nn.Module, num_classes: int, recipe: Mapping[str, Any], stage: int = 2):
        if stage not in (1, 2):
            raise ValueError(f"RAPTOR stage {stage!r}: valid stages are (1, 2)")
        super().__init__(model, num_classes, {**recipe, "mixup": 0.0, "cutmix": 0.0})
        self.stage = int(stage)

    def progress(self) -> float:
        return min(1.0, self.global_step / max(1, int(self.trainer.estimated_stepping_batches)))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        progress = self.progress()
        loss = self.check_finite(
            self.compiled("stage_loss")(batch[0], self.stage, progress), f"RAPTOR stage {self.stage} loss"
        )
        self.log(
            f"train/stage{self.stage}_loss", loss, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True
        )
        if self.stage == 1 and hasattr(self.model, "tau"):
            self.log("train/tau", self.model.tau(progress), on_step=True, on_epoch=False)
        return loss

    def _eval_step(self, batch, split: str) -> None:
        self.log_eval_loss(
            split, self.compiled("stage_loss")(batch[0], self.stage, 1.0), len(batch[0]), prog_bar=True
        )

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        """``recipe.grad_clip`` clips the norm of each of the model's ``clip_groups(stage)`` on
        its own (stage 1: one group per block, as RAPTOR clips each block in its own run) instead
        of Lightning's one norm over all parameters."""
        if not gradient_clip_val:
            return
        for group in self.model.clip_groups(self.stage):
            torch.nn.utils.clip_grad_norm_(group, float(gradient_clip_val))


OBJECTIVE_MODULES: dict[str, type[L.LightningModule]] = {
    "classify": ClassifyModule,
    "distill": DistillModule,
    "raptor": RaptorStageModule,
}


def module_for(objective: str) -> type[L.LightningModule]:
    """The LightningModule of a stage objective of ``objective: auto`` (another objective's module
    is the one its plug-in in :mod:`vitexp.training.objectives` names; it builds on :class:`ObjectiveModule`).
    """
    try:
        return OBJECTIVE_MODULES[objective]
    except KeyError:
        raise ValueError(
            f"no LightningModule for objective {objective!r}; known: {sorted(OBJECTIVE_MODULES)}"
        ) from None
