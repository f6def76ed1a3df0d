"""``data=coco``: COCO 2017 (or the micro COCO of :mod:`vitexp.detection.micro_coco`) in the standard
layout, ``<root>/{train2017,val2017}/`` and ``<root>/annotations/instances_{train,val}2017.json``, read
with torchvision's ``CocoDetection`` (pycocotools).

Its reasoning: docs/full-size.md, "vitexp/detection/coco_data.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from vitexp.data.datamodules import SEED_STRIDE, EpochSeededSampler, train_sampler


class CocoInstances(Dataset):
    """torchvision's ``CocoDetection`` turned into Mask R-CNN targets."""

    def __init__(
        self, images: Path, annotations: Path, hflip: float = 0.0, seed: int = 0, evaluation: bool = False
    ):
        from torchvision.datasets import CocoDetection

        self.coco_ds = CocoDetection(str(images), str(annotations))
        self.coco = self.coco_ds.coco
        self.cat_ids = sorted(self.coco.getCatIds())
        self.label_of = {c: i + 1 for i, c in enumerate(self.cat_ids)}
        self.hflip, self.seed, self.evaluation = float(hflip), int(seed), bool(evaluation)

    def __len__(self) -> int:
        return len(self.coco_ds)

    def target(self, index: int, height: int, width: int) -> dict[str, torch.Tensor]:
        """A training target, or with ``evaluation`` every annotation with ``iscrowd`` and ``area``
        (module docstring)."""
        image_id = self.coco_ds.ids[index]
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=image_id))
        if not self.evaluation:
            anns = [a for a in anns if not a.get("iscrowd", 0) and a["bbox"][2] >= 1 and a["bbox"][3] >= 1]
        boxes = torch.tensor(
            [[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)], dtype=torch.float32
        ).reshape(-1, 4)
        if not self.evaluation:
            boxes[:, 0::2].clamp_(0, width)
            boxes[:, 1::2].clamp_(0, height)
        masks = (
            torch.stack([torch.from_numpy(self.coco.annToMask(a)) for a in anns])
            if anns
            else torch.zeros((0, height, width), dtype=torch.uint8)
        )
        labels = torch.tensor([self.label_of[a["category_id"]] for a in anns], dtype=torch.int64)
        target = {"boxes": boxes, "labels": labels, "masks": masks, "image_id": torch.tensor(image_id)}
        if self.evaluation:
            target["iscrowd"] = torch.tensor([int(a.get("iscrowd", 0)) for a in anns], dtype=torch.int64)
            target["area"] = torch.tensor([float(a["area"]) for a in anns], dtype=torch.float64)
        return target

    def __getitem__(self, key: int | tuple[int, int]):
        """``key``: an index, or an ``(epoch, index)`` pair from the training samplers."""
        from torchvision.transforms.functional import pil_to_tensor

        epoch, index = key if isinstance(key, tuple) else (0, key)
        pil, _ = self.coco_ds[index]
        image = pil_to_tensor(pil.convert("RGB")).float().div_(255)
        target = self.target(index, image.shape[1], image.shape[2])
        if self.hflip > 0:  # a per-(epoch, index) draw: the same flips after a resume
            g = torch.Generator().manual_seed(self.seed * SEED_STRIDE + epoch * 7919 + index)
            if torch.rand((), generator=g) < self.hflip:
                width = image.shape[2]
                image = image.flip(-1)
                target["masks"] = target["masks"].flip(-1)
                boxes = target["boxes"].clone()
                boxes[:, 0], boxes[:, 2] = width - target["boxes"][:, 2], width - target["boxes"][:, 0]
                target["boxes"] = boxes
        return image, target


def collate_detection(batch):
    """Images of different sizes stay a list (the detector batches them)."""
    images, targets = zip(*batch)
    return list(images), list(targets)


class _EpochKeys:
    """A sampler mixin: yield ``(epoch, index)`` keys instead of indices (the epoch draws the flips)."""

    def __iter__(self):
        yield from ((self.epoch, i) for i in super().__iter__())


class _FlipEpochSampler(_EpochKeys, EpochSeededSampler):
    """The training sampler on one process."""


class _FlipDistributedSampler(_EpochKeys, DistributedSampler):
    """The training sampler under DDP (:func:`vitexp.data.datamodules.train_sampler`)."""


class CocoDataModule(L.LightningDataModule):
    """COCO 2017 train / val (val is also the test split)."""

    def __init__(
        self,
        root: str,
        name: str = "coco",
        num_classes: int = 80,
        batch_size: int = 2,
        num_workers: int = 4,
        train_dir: str = "train2017",
        val_dir: str = "val2017",
        hflip: float = 0.5,
        generate: Mapping[str, Any] | None = None,
        data_config: dict[str, Any] | None = None,
        loader_seed: int = 0,
    ):
        super().__init__()
        self.generate = dict(generate) if generate else None
        self.root = Path(str(root)).expanduser()
        self.name, self.num_classes = name, int(num_classes)
        self.batch_size, self.num_workers = int(batch_size), int(num_workers)
        self.dirs = {"train": train_dir, "val": val_dir}
        self.hflip, self.loader_seed = float(hflip), int(loader_seed)
        self.data_config = dict(data_config or {})
        self.train_set = self.val_set = self.test_set = None

    def _split(self, split: str, hflip: float) -> CocoInstances:
        """The split's dataset: training targets for ``train``, evaluation targets (crowds kept,
        flagged) for ``val``."""
        sub = self.dirs[split]
        images = self.root / sub
        annotations = self.root / "annotations" / f"instances_{sub}.json"
        for path in (images, annotations):
            if not path.exists():
                raise FileNotFoundError(
                    f"{self.name} {split} split: {path} not found (COCO 2017 layout: "
                    f"<root>/{sub}/ and <root>/annotations/instances_{sub}.json)"
                )
        ds = CocoInstances(
            images, annotations, hflip=hflip, seed=self.loader_seed, evaluation=split != "train"
        )
        if len(ds.cat_ids) != self.num_classes:
            raise ValueError(
                f"{annotations} has {len(ds.cat_ids)} categories but data.num_classes={self.num_classes}"
            )
        return ds

    def prepare_data(self) -> None:
        """Lightning calls this on one process per node before ``setup``: the micro COCO is written here."""
        if not self.root.is_dir() and self.generate is not None:
            from vitexp.detection.micro_coco import make_micro_coco

            make_micro_coco(self.root, **self.generate)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.prepare_data()  # outside a Trainer (tools, tests)
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.name} root not found: {self.root}")
        self.train_set = self._split("train", self.hflip)
        self.val_set = self.test_set = self._split("val", 0.0)

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        """Validation and test keep Lightning's padded ``DistributedSampler`` under DDP: torchmetrics'
        ``MeanAveragePrecision`` gathers one tensor per image and needs every rank to hold as many
        images (unequal shards abort gloo and can hang NCCL). The up to W − 1 repeated images are
        emptied before the metric sees them (``DetectModule._padding``), so every image counts
        once; :func:`vitexp.data.datamodules.eval_sampler` is the classification modules' unpadded sampler."""
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            collate_fn=collate_detection,
            sampler=(
                train_sampler(
                    dataset, self.loader_seed, single=_FlipEpochSampler, distributed=_FlipDistributedSampler
                )
                if train
                else None
            ),
            drop_last=train and len(dataset) > self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.loader_seed + (0 if train else 1)),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)
