"""``data=fashion_mnist``: Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (the four
IDX files, read by :mod:`vitexp.data.idx`), kept in memory as uint8 and prepared a batch at a time
(docs/fashion-mnist.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from vitexp.data.datamodules import VitexpDataModule

#: Where the Debian package ``dataset-fashion-mnist`` installs the four IDX files.
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def fashion_mnist_files(
    root: str | Path, package: str = FASHION_MNIST_PACKAGE
) -> dict[str, tuple[Path, Path]]:
    """The (images, labels) IDX files of each split under ``root``; a missing one is a
    ``FileNotFoundError`` naming the Debian package and the command that installs it."""
    root = Path(str(root)).expanduser()
    files = {split: (root / imgs, root / labels) for split, (imgs, labels) in FASHION_MNIST_FILES.items()}
    missing = [str(p) for pair in files.values() for p in pair if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST not found: {', '.join(missing)}. Install the Debian package {package} (apt-get"
            f" install -y {package}, as root; it puts the IDX files in {FASHION_MNIST_ROOT}) or set data.root"
            f" to a folder holding {sorted(n for pair in FASHION_MNIST_FILES.values() for n in pair)}"
        )
    return files


def load_fashion_mnist(
    root: str | Path, package: str = FASHION_MNIST_PACKAGE
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"train": (60000×28×28 uint8 images, labels), "test": (10000×28×28, labels)} from the IDX files."""
    from vitexp.data.idx import IMAGES_MAGIC, LABELS_MAGIC, read_idx

    out = {}
    for split, (imgs, labels) in fashion_mnist_files(root, package).items():
        x = torch.from_numpy(read_idx(imgs, IMAGES_MAGIC).copy())
        y = torch.from_numpy(read_idx(labels, LABELS_MAGIC).astype(np.int64))
        if len(x) != len(y):
            raise ValueError(f"{imgs} holds {len(x)} images but {labels} {len(y)} labels")
        out[split] = (x, y)
    return out


def split_train_val(labels: torch.Tensor, val_size: int, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The sorted (train, validation) indices of the 60,000 training images: a stratified ``val_size``
    drawn with ``split_seed`` (:class:`FashionMNISTDataModule`'s validation split)."""
    from sklearn.model_selection import train_test_split

    if not 0 < val_size < len(labels):
        raise ValueError(f"data.val_size={val_size} must be in (0, {len(labels)})")
    train_idx, val_idx = train_test_split(
        np.arange(len(labels)), test_size=val_size, stratify=labels.numpy(), random_state=split_seed
    )
    return np.sort(train_idx), np.sort(val_idx)


class GreyBatchDataset(Dataset):
    """Grey uint8 images kept in memory, prepared a batch at a time (``__getitems__``: the
    DataLoader hands it the batch's indices, so there is no per-image Python transform).

    A batch is: optional training augmentation on the 28×28 uint8 images (random translation by
    up to ``translate`` px with zero fill, horizontal flip with probability 0.5, drawn from the
    global torch RNG that ``seed_everything`` seeds), nearest-neighbour upscaling by the integer
    factor ``img_size // side``, zero padding centred to ``img_size``, grey repeated to 3
    channels, then ``(x / 255 - mean) / std`` with the backbone's data config."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        img_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        translate: int = 0,
        flip: bool = False,
    ):
        side = int(images.shape[-1])
        if img_size < side:
            raise ValueError(f"backbone resolution {img_size} px is below the images' {side} px")
        self.images, self.labels = images, labels
        self.scale = img_size // side
        self.pad = img_size - self.scale * side
        self.translate, self.flip = int(translate), bool(flip)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        n, h, w = x.shape
        if self.translate:
            t = self.translate
            padded = F.pad(x, (t, t, t, t))
            dy, dx = torch.randint(0, 2 * t + 1, (2, n, 1, 1))
            rows = dy + torch.arange(h).view(1, h, 1)
            cols = dx + torch.arange(w).view(1, 1, w)
            x = padded[torch.arange(n).view(n, 1, 1), rows, cols]
        if self.flip:
            x = torch.where(torch.rand(n, 1, 1) < 0.5, x.flip(-1), x)
        return x

    def batch(self, index: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(index, dtype=torch.long)
        x = self._augment(self.images[idx])
        if self.scale > 1:
            x = x.repeat_interleave(self.scale, dim=-2).repeat_interleave(self.scale, dim=-1)
        if self.pad:
            before = self.pad // 2
            x = F.pad(x, (before, self.pad - before, before, self.pad - before))
        x = (x.unsqueeze(1).float().div_(255.0).expand(-1, 3, -1, -1) - self.mean) / self.std
        return x, self.labels[idx]

    def __getitems__(self, index: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.batch(index)
        return list(zip(x, y))

    def __getitem__(self, i: int):
        x, y = self.batch([i])
        return x[0], y[0]


class FashionMNISTDataModule(VitexpDataModule):
    """Fashion-MNIST (Xiao et al. 2017: 60,000 training and 10,000 test 28×28 grey images of 10
    clothing classes) from the IDX files of the Debian package ``dataset-fashion-mnist``.

    Decisions: validation is a fixed stratified ``val_size`` carved from the 60,000 training
    images (``split_seed``); the 10,000 test images are only the test split (evaluated once, after
    training). Images stay 28×28 uint8 in memory and are prepared per batch by
    :class:`GreyBatchDataset`: upscaled by the integer factor that fits the backbone's resolution
    (nearest neighbour: 32 px -> ×1, 56 and 64 px -> ×2), zero-padded centred to that resolution
    (Fashion-MNIST's background is 0), grey repeated to 3 channels (the backbones keep 3-channel
    patch embeddings, as the paper-scale ones), normalised with the backbone's mean and std.
    Training augmentation (``augment``, off by default: it slowed the tier's short schedules):
    random translation by up to ``translate`` px and horizontal flips."""

    def __init__(
        self,
        root: str = FASHION_MNIST_ROOT,
        name: str = "fashion_mnist",
        num_classes: int = 10,
        batch_size: int = 128,
        num_workers: int = 0,
        val_size: int = 5000,
        split_seed: int = 0,
        augment: bool = False,
        translate: int = 2,
        package: str = FASHION_MNIST_PACKAGE,
        data_config: dict[str, Any] | None = None,
        loader_seed: int = 0,
    ):
        super().__init__(name, num_classes, batch_size, num_workers, data_config, loader_seed)
        self.root = Path(str(root)).expanduser()
        self.package = package
        self.val_size, self.split_seed = int(val_size), int(split_seed)
        self.augment, self.translate = bool(augment), int(translate)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = load_fashion_mnist(self.root, self.package)
        images, labels = data["train"]
        train_idx, val_idx = split_train_val(labels, self.val_size, self.split_seed)
        self.split_indices = {"train": train_idx, "val": val_idx}
        cfg = self.data_config

        def dataset(x, y, train=False):
            return GreyBatchDataset(
                x,
                y,
                self.img_size,
                cfg["mean"],
                cfg["std"],
                translate=self.translate if train and self.augment else 0,
                flip=train and self.augment,
            )

        train_x, train_y = images[train_idx], labels[train_idx]
        self.train_set = dataset(train_x, train_y, train=True)
        self.train_eval_set = dataset(train_x, train_y)
        self.val_set = dataset(images[val_idx], labels[val_idx])
        self.test_set = dataset(*data["test"])
