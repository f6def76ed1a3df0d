"""The ``detect`` objective: a LightningModule that trains torchvision's Mask R-CNN (its own losses: RPN
objectness and box, RoI class, box and mask) and evaluates COCO box and mask AP with
``torchmetrics.detection.MeanAveragePrecision`` (``iou_type=("bbox", "segm")``, pycocotools backend,
crowd regions flagged ``iscrowd``: COCOeval's own numbers). It never knows which method produced the
backbone.

Its reasoning: docs/commands.md, "vitexp/training/detection_module.py".
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from vitexp.training.modules import ObjectiveModule

#: torchmetrics' result keys -> vitexp's metric names.
AP_KEYS = {
    "bbox_map": "ap_box",
    "bbox_map_50": "ap_box_50",
    "bbox_map_75": "ap_box_75",
    "segm_map": "ap_mask",
    "segm_map_50": "ap_mask_50",
    "segm_map_75": "ap_mask_75",
}


def mean_average_precision():
    """torchmetrics' ``MeanAveragePrecision`` on pycocotools' COCOeval with COCOeval's own IoU and
    recall thresholds (``pycocotools.cocoeval.Params``): torchmetrics' defaults are the same values
    from ``torch.linspace``, which differ in the last bits, and an IoU or a recall that falls exactly
    on a threshold (integer boxes do) would then count differently from COCOeval's."""
    from pycocotools.cocoeval import Params
    from torchmetrics.detection import MeanAveragePrecision

    coco = Params(iouType="bbox")
    return MeanAveragePrecision(
        iou_type=("bbox", "segm"),
        backend="pycocotools",
        iou_thresholds=coco.iouThrs.tolist(),
        rec_thresholds=coco.recThrs.tolist(),
        max_detection_thresholds=list(coco.maxDets),
    )


#: Target keys the metric reads besides boxes, labels and masks: crowd flags (COCOeval ignores the
#: detections that fall on a crowd) and the annotation's area (which sets its small / medium / large range).
EVALUATION_KEYS = ("iscrowd", "area")


def to_metric_inputs(
    preds: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]], mask_threshold: float = 0.5
):
    """Mask R-CNN outputs and dataset targets as MeanAveragePrecision wants them (boolean N×H×W masks;
    a target's ``iscrowd`` and ``area`` passed on where the dataset gives them: evaluation targets,
    :mod:`vitexp.detection.coco_data`)."""
    p = [
        {
            "boxes": o["boxes"],
            "scores": o["scores"],
            "labels": o["labels"],
            "masks": (o["masks"][:, 0] > mask_threshold) if o["masks"].dim() == 4 else o["masks"].bool(),
        }
        for o in preds
    ]
    t = [
        {
            "boxes": g["boxes"],
            "labels": g["labels"],
            "masks": g["masks"].bool(),
            **{k: g[k] for k in EVALUATION_KEYS if k in g},
        }
        for g in targets
    ]
    return p, t


def ap_metrics(result: Mapping[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(result[key]) for key, name in AP_KEYS.items() if key in result}


class DetectModule(ObjectiveModule):
    """Trains and evaluates a torchvision detector (``model(images, targets)`` -> loss dict in
    training, ``model(images)`` -> detections in evaluation). From :class:`ObjectiveModule`: the
    RNG states saved with each checkpoint (exact resume), the finite-loss guard, the per-step
    scheduler update; the optimizer and schedule are the 1× schedule's (below)."""

    def __init__(self, model: nn.Module, num_classes: int, recipe: Mapping[str, Any]):
        super().__init__(model, num_classes, recipe)
        self.val_map = mean_average_precision()
        self.test_map = mean_average_precision()

    def compiled(self, entry: str = "forward"):
        """Under ``compile``, the detector's backbone and FPN (``model.backbone``) compiled whole; the
        RPN, RoI heads and transform stay eager: torchvision's box code has data-dependent shapes
        (NMS, the proposals kept, ``.item()`` in the resize), 37 graph breaks in training
        (docs/measurements.md, "Compiled")."""
        if entry != "backbone":
            return super().compiled(entry)
        backbone = self.model.backbone
        if self.compile_options is None:
            return backbone
        key = (id(self.model), entry)
        if key not in self._compiled:
            from vitexp.models.compiled import compile_call

            self._compiled[key] = compile_call(type(backbone).forward.__get__(backbone), self.compile_options)
        return self._compiled[key]

    def detect(self, images, targets=None):
        """``self.model(images[, targets])`` with its backbone's forward compiled for this call only
        (the model itself is never left patched: FLOPs counts and copies see the plain module)."""
        if self.compile_options is None:
            return self.model(images) if targets is None else self.model(images, targets)
        backbone = self.model.backbone
        backbone.forward = self.compiled("backbone")
        try:
            return self.model(images) if targets is None else self.model(images, targets)
        finally:
            del backbone.forward

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, targets = batch
        losses = self.detect(images, targets)
        loss = sum(losses.values())
        if not torch.isfinite(loss):  # the guard's error, with the loss terms
            self.check_finite(loss, f"detection loss ({ {k: float(v) for k, v in losses.items()} })")
        bs = len(images)
        self.log(
            "train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True, batch_size=bs
        )
        for k, v in losses.items():
            self.log(f"train/{k}", v, on_step=False, on_epoch=True, sync_dist=True, batch_size=bs)
        return loss

    def _eval_step(self, batch, batch_idx: int, metric, split: str) -> None:
        images, targets = batch
        preds, gts = to_metric_inputs(self.detect(images), targets)
        for i in self._padding(batch_idx, len(gts), split):  # scored as an image with nothing on it
            preds[i] = {k: v[:0] for k, v in preds[i].items()}
            gts[i] = {k: v[:0] for k, v in gts[i].items()}
        metric.update(preds, gts)

    def _padding(self, batch_idx: int, count: int, split: str) -> list[int]:
        """The positions in this batch of the images Lightning's padded ``DistributedSampler`` repeats
        (:mod:`vitexp.detection.coco_data`): rank r's j-th image is the split's image r + jW, a repeat
        when r + jW ≥ N. They stay in the metric (its per-image gather needs as many on every rank)
        but with no detections and no ground truth, which adds nothing to AP, so every image counts
        exactly once."""
        trainer = self.trainer
        world = int(trainer.world_size)
        if world <= 1:
            return []
        dm = trainer.datamodule
        n = len(dm.val_set if split == "val" else dm.test_set)
        first = batch_idx * int(dm.batch_size)
        return [i for i in range(count) if trainer.global_rank + (first + i) * world >= n]

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, self.val_map, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, self.test_map, "test")

    def _log_map(self, split: str, metric) -> None:
        for name, value in ap_metrics(metric.compute()).items():
            self.log(f"{split}/{name}", value, prog_bar=name in ("ap_box", "ap_mask"), sync_dist=False)
        metric.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_map("val", self.val_map)

    def on_test_epoch_end(self) -> None:
        self._log_map("test", self.test_map)

    def configure_optimizers(self):
        from timm.optim import create_optimizer_v2
        from timm.scheduler import create_scheduler_v2

        r = self.recipe
        kwargs = {"momentum": float(r["momentum"])} if r.get("momentum") is not None else {}
        optimizer = create_optimizer_v2(
            self.model, opt=r["opt"], lr=self.effective_lr(), weight_decay=float(r["weight_decay"]), **kwargs
        )
        epochs = int(r["epochs"])
        steps_per_epoch = max(1, int(self.trainer.estimated_stepping_batches) // epochs)
        sched_kwargs: dict[str, Any] = {}
        if r.get("sched", "multistep") == "multistep":
            sched_kwargs = {
                "decay_milestones": [int(e) for e in r.get("decay_epochs", (8, 11))],
                "decay_rate": float(r.get("decay_rate", 0.1)),
            }
        total = epochs * steps_per_epoch
        scheduler, _ = create_scheduler_v2(
            optimizer,
            sched=r.get("sched", "multistep"),
            num_epochs=epochs,
            warmup_epochs=min(int(r.get("warmup_steps", 0)), total - 1) / steps_per_epoch,
            warmup_lr=float(r.get("warmup_lr", 1e-5)),
            min_lr=float(r.get("min_lr", 0.0)),
            step_on_epochs=False,
            updates_per_epoch=steps_per_epoch,
            **sched_kwargs,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
