"""``data=synthetic_coco``: random instance-segmentation samples at any image size, for the rehearsal of a
detection row at full size (:mod:`vitexp.cost.rehearsal`): no dataset on disk, no download.

Its reasoning: docs/full-size.md, "vitexp/detection/synthetic.py".
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.utils.data import Dataset

from vitexp.detection.coco_data import CocoDataModule

#: Sizes of a generated split when ``generate`` does not say (the rehearsal always does).
DEFAULT_GENERATE = {"height": 800, "width": 1280, "max_items": 4}


class SyntheticInstances(Dataset):
    """``n`` random instance-segmentation samples (module docstring)."""

    def __init__(self, n: int, height: int, width: int, num_classes: int, max_items: int, seed: int):
        if min(n, height, width, num_classes, max_items) < 1:
            raise ValueError(
                f"synthetic_coco: n={n}, height={height}, width={width}, num_classes={num_classes} and "
                f"max_items={max_items} must all be at least 1"
            )
        self.n, self.height, self.width = int(n), int(height), int(width)
        self.num_classes, self.max_items, self.seed = int(num_classes), int(max_items), int(seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: int | tuple[int, int]):
        """``key``: an index, or an ``(epoch, index)`` pair from the training samplers."""
        index = key[1] if isinstance(key, tuple) else key
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        h, w = self.height, self.width
        image = 0.1 * torch.randn(3, h, w, generator=g) + 0.5
        items = int(torch.randint(1, self.max_items + 1, (), generator=g))
        boxes, masks = [], torch.zeros((items, h, w), dtype=torch.uint8)
        for i in range(items):
            bw = int(torch.randint(max(2, w // 16), max(3, w // 3), (), generator=g))
            bh = int(torch.randint(max(2, h // 16), max(3, h // 3), (), generator=g))
            x0 = int(torch.randint(0, w - bw + 1, (), generator=g))
            y0 = int(torch.randint(0, h - bh + 1, (), generator=g))
            image[:, y0 : y0 + bh, x0 : x0 + bw] = torch.rand(3, 1, 1, generator=g)
            masks[i, y0 : y0 + bh, x0 : x0 + bw] = 1
            boxes.append([x0, y0, x0 + bw, y0 + bh])
        labels = torch.randint(1, self.num_classes + 1, (items,), generator=g)
        target = {
            "boxes": torch.tensor(boxes, dtype=torch.float32),
            "labels": labels,
            "masks": masks,
            "image_id": torch.tensor(index),
        }
        return image.clamp_(0, 1), target


class SyntheticCocoDataModule(CocoDataModule):
    """COCO's loaders over :class:`SyntheticInstances` (val is also the test split, as COCO's)."""

    def __init__(
        self,
        name: str = "synthetic_coco",
        num_classes: int = 80,
        batch_size: int = 2,
        num_workers: int = 0,
        num_train: int = 8,
        num_val: int = 4,
        seed: int = 0,
        generate: Mapping[str, Any] | None = None,
        root: str | None = None,
        data_config: dict[str, Any] | None = None,
        loader_seed: int = 0,
    ):
        super().__init__(
            root=str(root or "<synthetic>"),
            name=name,
            num_classes=num_classes,
            batch_size=batch_size,
            num_workers=num_workers,
            hflip=0.0,
            generate=None,
            data_config=data_config,
            loader_seed=loader_seed,
        )
        self.sizes = {"train": int(num_train), "val": int(num_val)}
        self.shape = {**DEFAULT_GENERATE, **dict(generate or {})}
        self.sample_seed = int(seed)

    def prepare_data(self) -> None:
        """Nothing to write: samples are drawn when read."""

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        h, w, items = (int(self.shape[k]) for k in ("height", "width", "max_items"))
        self.train_set = SyntheticInstances(
            self.sizes["train"], h, w, self.num_classes, items, self.sample_seed
        )
        self.val_set = self.test_set = SyntheticInstances(
            self.sizes["val"], h, w, self.num_classes, items, self.sample_seed + 1
        )
