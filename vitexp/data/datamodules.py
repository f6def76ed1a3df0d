"""LightningDataModules: digits, synthetic, imagenet / imagefolder, cifar100 (fashion_mnist:
:mod:`vitexp.data.fashion_mnist`; another objective's data: the one its plug-in in
:mod:`vitexp.training.objectives` builds).

Its reasoning: docs/measurements.md, "vitexp/data/datamodules.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Subset, TensorDataset

DEFAULT_DATA_CONFIG = {
    "input_size": (3, 224, 224),
    "interpolation": "bicubic",
    "mean": (0.485, 0.456, 0.406),
    "std": (0.229, 0.224, 0.225),
    "crop_pct": 0.875,
    "crop_mode": "center",
}


SEED_STRIDE = 1_000_003  # seeds apart: an epoch count no run reaches
DATA_ORDER = "seed*1000003+epoch"  # a train run's ledger protocol names the order its sampler drew


class EpochSeededSampler(RandomSampler):
    """A random permutation drawn from ``seed * SEED_STRIDE + epoch`` (Lightning calls ``set_epoch``).

    The stride keeps the runs of different seeds on disjoint orders: with ``seed + epoch`` the
    second epoch of seed s repeated the first of seed s + 1, which correlates the seeds a table
    averages over. Seed 0 draws the same orders under both formulas.
    Under DDP the data modules use :func:`train_sampler`'s ``DistributedSampler`` instead; this one
    subclasses ``RandomSampler`` so that Lightning still shards it if it meets it there."""

    def __init__(self, data_source: Sequence, seed: int = 0):
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * SEED_STRIDE + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=g).tolist()


def train_sampler(
    dataset: Sequence,
    seed: int,
    num_replicas: int | None = None,
    rank: int | None = None,
    single: type | None = None,
    distributed: type = DistributedSampler,
):
    """The training sampler: :class:`EpochSeededSampler`, or under DDP (an initialised process group,
    a group of one included, or ``num_replicas`` > 1 given) a ``DistributedSampler`` seeded with
    ``seed * SEED_STRIDE``, so each rank's share of epoch e comes from ``seed * SEED_STRIDE + e`` as on
    one process (over one replica it is that order). Lightning keeps a ``DistributedSampler`` it is
    given; under a DDP strategy it replaces any other sampler, a ``RandomSampler`` subclass on one
    device too, with its own seeded ``seed + epoch``.
    ``single`` / ``distributed``: subclasses to use instead (COCO's yield ``(epoch, index)`` keys)."""
    in_group = (
        num_replicas is None and torch.distributed.is_available() and torch.distributed.is_initialized()
    )
    if in_group:
        num_replicas, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if in_group or (num_replicas or 1) > 1:
        return distributed(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed * SEED_STRIDE
        )
    return (single or EpochSeededSampler)(dataset, seed)


def eval_sampler(dataset: Sequence):
    """The sampler of a validation or test split: none on one process (the split in order); under DDP
    (an initialised process group of two or more) Lightning's ``UnrepeatedDistributedSampler``, which
    gives rank r the images r, r + W, r + 2W, … and pads nothing, so every image is counted exactly
    once whatever the world size (Lightning's default, a ``DistributedSampler``, repeats up to W − 1
    images to even out the shards; ImageNet's 50,000 on 3 GPUs counts two twice). Lightning keeps a
    ``DistributedSampler`` subclass it is given. Shards may differ by one batch: evaluation has no
    gradient all-reduce, and the metrics (torchmetrics states, Lightning's epoch-level means, the k-NN
    gather) reduce sums and counts once per epoch."""
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

        return UnrepeatedDistributedSampler(dataset, shuffle=False)
    return None


class _TransformedTensorDataset(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform=None):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.labels[i]


class VitexpDataModule(L.LightningDataModule):
    """Shared loader logic; subclasses build ``self.train_set``, ``self.val_set``, ``self.test_set``."""

    def __init__(
        self,
        name: str,
        num_classes: int,
        batch_size: int,
        num_workers: int = 0,
        data_config: dict[str, Any] | None = None,
        loader_seed: int = 0,
    ):
        super().__init__()
        self.name = name
        self.num_classes = int(num_classes)
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.data_config = {**DEFAULT_DATA_CONFIG, **(data_config or {})}
        self.loader_seed = int(loader_seed)
        self.train_set = self.val_set = self.test_set = None
        self.train_eval_set = None  # the training split with evaluation transforms (k-NN memory bank)

    @property
    def img_size(self) -> int:
        return int(self.data_config["input_size"][-1])

    def _loader(self, dataset: Dataset, train: bool, shard: bool = True) -> DataLoader:
        """``shard=False``: a split the caller has sharded already (the k-NN memory bank)."""
        generator = torch.Generator().manual_seed(self.loader_seed + (0 if train else 1))
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=(
                train_sampler(dataset, self.loader_seed)
                if train
                else eval_sampler(dataset)
                if shard
                else None
            ),
            shuffle=False if not train else None,
            drop_last=train and len(dataset) > self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            generator=generator,
        )

    #: Whether :meth:`train_dataloader` applies the training augmentations (a stage may train on
    #: the evaluation transforms instead: RAPTOR's distillation, as its precomputed activations).
    train_augment: bool = True

    def train_dataloader(self) -> DataLoader:
        """The training split in the training order (:func:`train_sampler`), with its augmentations,
        or with the evaluation transforms while ``train_augment`` is False."""
        if not self.train_augment and self.train_eval_set is not None:
            return self._loader(self.train_eval_set, train=True)
        return self._loader(self.train_set, train=True)

    def train_eval_dataloader(self, rank: int = 0, world_size: int = 1) -> DataLoader:
        """The training split in order, with evaluation transforms (a k-NN classifier's memory bank).
        Under DDP, rank r of W gets the contiguous shard [⌊rN/W⌋, ⌊(r+1)N/W⌋): every image belongs to
        exactly one rank and nothing is padded (a ``DistributedSampler`` would repeat images), and
        the shards in rank order are the split in order."""
        dataset = self.train_eval_set if self.train_eval_set is not None else self.train_set
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if world_size > 1:
            n = len(dataset)
            dataset = Subset(dataset, range(rank * n // world_size, (rank + 1) * n // world_size))
        return self._loader(dataset, train=False, shard=False)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)


class DigitsDataModule(VitexpDataModule):
    """scikit-learn's handwritten digits (1,797 real 8×8 images, 10 classes).

    Pixels 0..16 are scaled to [0, 1], upsampled bilinearly to the model's resolution, repeated to
    3 channels and normalised with the model's mean/std. The split is stratified and fixed by
    ``split_seed``. Training images get a small random affine jitter (torchvision v2)."""

    def __init__(
        self,
        name: str = "digits",
        num_classes: int = 10,
        batch_size: int = 64,
        num_workers: int = 0,
        split: Sequence[float] = (0.6, 0.2, 0.2),
        split_seed: int = 0,
        augment: bool = True,
        data_config: dict[str, Any] | None = None,
        loader_seed: int = 0,
    ):
        super().__init__(name, num_classes, batch_size, num_workers, data_config, loader_seed)
        self.split = tuple(float(s) for s in split)
        self.split_seed = int(split_seed)
        self.augment = bool(augment)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        images = F.interpolate(
            images, size=(self.img_size, self.img_size), mode="bilinear", align_corners=False
        )
        images = images.repeat(1, 3, 1, 1)
        idx = np.arange(len(labels))
        train_frac, val_frac, test_frac = self.split
        train_idx, rest = train_test_split(
            idx, train_size=train_frac, stratify=labels.numpy(), random_state=self.split_seed
        )
        val_idx, test_idx = train_test_split(
            rest,
            test_size=test_frac / (val_frac + test_frac),
            stratify=labels.numpy()[rest],
            random_state=self.split_seed,
        )
        self.split_indices = {"train": train_idx, "val": val_idx, "test": test_idx}
        from torchvision.transforms import v2

        normalize = v2.Normalize(mean=list(self.data_config["mean"]), std=list(self.data_config["std"]))
        train_tf = v2.Compose(
            [v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)), normalize]
        )
        self.train_set = _TransformedTensorDataset(
            images[train_idx], labels[train_idx], train_tf if self.augment else normalize
        )
        self.train_eval_set = _TransformedTensorDataset(images[train_idx], labels[train_idx], normalize)
        self.val_set = _TransformedTensorDataset(images[val_idx], labels[val_idx], normalize)
        self.test_set = _TransformedTensorDataset(images[test_idx], labels[test_idx], normalize)


class SyntheticDataModule(VitexpDataModule):
    """Class-conditional synthetic images: each class has a fixed smooth random prototype
    (8×8 noise upsampled), and a sample is its prototype plus Gaussian noise of std ``noise``."""

    def __init__(
        self,
        name: str = "synthetic",
        num_classes: int = 10,
        batch_size: int = 64,
        num_workers: int = 0,
        num_train: int = 512,
        num_val: int = 128,
        num_test: int = 128,
        noise: float = 0.5,
        seed: int = 0,
        data_config: dict[str, Any] | None = None,
        loader_seed: int = 0,
    ):
        super().__init__(name, num_classes, batch_size, num_workers, data_config, loader_seed)
        self.sizes = (int(num_train), int(num_val), int(num_test))
        self.noise = float(noise)
        self.seed = int(seed)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        g = torch.Generator().manual_seed(self.seed)
        size = self.img_size
        protos = F.interpolate(
            torch.randn(self.num_classes, 3, 8, 8, generator=g),
            size=(size, size),
            mode="bilinear",
            align_corners=False,
        )
        sets = []
        for n in self.sizes:
            labels = torch.randint(0, self.num_classes, (n,), generator=g)
            images = protos[labels] + self.noise * torch.randn(n, 3, size, size, generator=g)
            sets.append(TensorDataset(images, labels))
        self.train_set, self.val_set, self.test_set = sets


def _require_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def _posterize_keeping_zero_bits(img, bits_to_keep, **__):
    """timm's RandAugment ``PosterizeIncreasing`` asks for 0 bits at magnitude 10 (DeiT's
    ``rand-m9-mstd0.5-inc1`` reaches it); Pillow >= 11 rejects 0 where older Pillow, which DeiT
    was trained with, masked every bit off (a black image). vitexp keeps the old behaviour."""
    from PIL import Image, ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


def _patch_timm_posterize() -> None:
    import timm.data.auto_augment as aa

    for name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
        if aa.NAME_TO_OP.get(name) is aa.posterize:
            aa.NAME_TO_OP[name] = _posterize_keeping_zero_bits


def timm_transforms(
    data_config: dict[str, Any], train: bool, auto_augment: str | None = None, random_erase: float = 0.0
):
    """timm's ImageNet transforms for the model's data config (RandomResizedCrop + flip + RandAugment
    + random erasing for training; resize to size / crop_pct + center crop for evaluation)."""
    from timm.data import create_transform

    _patch_timm_posterize()
    data_config = {**DEFAULT_DATA_CONFIG, **data_config}
    return create_transform(
        input_size=data_config["input_size"],
        is_training=train,
        interpolation=data_config["interpolation"],
        mean=data_config["mean"],
        std=data_config["std"],
        crop_pct=data_config["crop_pct"],
        auto_augment=auto_augment if train else None,
        re_prob=random_erase if train else 0.0,
    )


class ImageFolderDataModule(VitexpDataModule):
    """ImageNet or any ImageFolder dataset: ``<root>/<train_dir>``, ``<root>/<val_dir>``,
    optional ``<root>/<test_dir>`` (else the val split is the test split).

    ``decoder``: ``tensor`` (:mod:`vitexp.data.tensor_images`: ``decode_jpeg`` and transforms v2 on uint8; the
    default, the faster loader beyond the spread of repeated runs, docs/cluster.md; the training split's
    batches are normalised and randomly erased on the device by :meth:`on_after_batch_transfer`, the
    other splits are normalised in the workers, since code reads them outside Lightning's hooks) or
    ``pil`` (timm's PIL transforms, :func:`timm_transforms`, as the papers' recipes ran)."""

    def __init__(
        self,
        root: str,
        name: str = "imagefolder",
        num_classes: int = 1000,
        batch_size: int = 128,
        num_workers: int = 8,
        train_dir: str = "train",
        val_dir: str = "val",
        test_dir: str | None = None,
        auto_augment: str | None = None,
        random_erase: float = 0.0,
        data_config: dict[str, Any] | None = None,
        loader_seed: int = 0,
        decoder: str = "tensor",
    ):
        from vitexp.data.tensor_images import DECODERS

        super().__init__(name, num_classes, batch_size, num_workers, data_config, loader_seed)
        if decoder not in DECODERS:
            raise ValueError(f"data.decoder={decoder!r}: valid decoders are {DECODERS}")
        self.root = Path(str(root)).expanduser()
        self.dirs = {"train": train_dir, "val": val_dir, "test": test_dir or val_dir}
        self.auto_augment, self.random_erase = auto_augment, float(random_erase or 0.0)
        self.decoder = decoder
        self.device_normalize = None

    def _dataset(self, folder: Path, split: str):
        """The ImageFolder of ``split`` (``train_eval``: the training images, evaluation transforms)."""
        from torchvision.datasets import ImageFolder

        train = split == "train"
        if self.decoder == "pil":
            tf = timm_transforms(self.data_config, train, self.auto_augment, self.random_erase)
            return ImageFolder(str(folder), transform=tf)
        from vitexp.data.tensor_images import decode_rgb, normalised_eval_transform, tensor_transform

        tf = (
            tensor_transform(self.data_config, True, self.auto_augment)
            if train
            else normalised_eval_transform(self.data_config)
        )
        return ImageFolder(str(folder), transform=tf, loader=decode_rgb)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        _require_dir(self.root, f"{self.name} root")
        sets = {}
        for split, sub in self.dirs.items():
            folder = _require_dir(self.root / sub, f"{self.name} {split} split")
            sets[split] = self._dataset(folder, split)
            if split == "train":
                self.train_eval_set = self._dataset(folder, "train_eval")
            if len(sets[split].classes) != self.num_classes:
                raise ValueError(
                    f"{folder} has {len(sets[split].classes)} class folders but"
                    f" data.num_classes={self.num_classes}"
                )
        self.train_set, self.val_set, self.test_set = sets["train"], sets["val"], sets["test"]
        if self.decoder == "tensor":
            from vitexp.data.tensor_images import DeviceNormalize

            self.device_normalize = DeviceNormalize(
                self.data_config["mean"], self.data_config["std"], self.random_erase
            )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """``decoder=tensor``: a uint8 batch on the device normalised (and erased while training)."""
        if self.device_normalize is None:
            return batch
        x, *rest = batch
        training = self.trainer is not None and self.trainer.training
        return [self.device_normalize(x, train=training), *rest]


class CIFAR100DataModule(VitexpDataModule):
    """CIFAR-100 from a local torchvision root (``<root>/cifar-100-python``), never downloaded;
    val is a fixed stratified ``val_fraction`` of the training set, test is CIFAR's test set."""

    def __init__(
        self,
        root: str,
        name: str = "cifar100",
        num_classes: int = 100,
        batch_size: int = 128,
        num_workers: int = 8,
        val_fraction: float = 0.02,
        split_seed: int = 0,
        auto_augment: str | None = None,
        random_erase: float = 0.0,
        data_config: dict[str, Any] | None = None,
        loader_seed: int = 0,
    ):
        super().__init__(name, num_classes, batch_size, num_workers, data_config, loader_seed)
        self.root = Path(str(root)).expanduser()
        self.val_fraction, self.split_seed = float(val_fraction), int(split_seed)
        self.auto_augment, self.random_erase = auto_augment, float(random_erase or 0.0)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.model_selection import train_test_split
        from torch.utils.data import Subset
        from torchvision.datasets import CIFAR100

        _require_dir(self.root / "cifar-100-python", "CIFAR-100 (python version) folder")
        train_tf = timm_transforms(self.data_config, True, self.auto_augment, self.random_erase)
        eval_tf = timm_transforms(self.data_config, False)
        full_train = CIFAR100(str(self.root), train=True, transform=train_tf, download=False)
        full_eval = CIFAR100(str(self.root), train=True, transform=eval_tf, download=False)
        idx = np.arange(len(full_train.targets))
        train_idx, val_idx = train_test_split(
            idx, test_size=self.val_fraction, stratify=full_train.targets, random_state=self.split_seed
        )
        self.train_set = Subset(full_train, train_idx)
        self.val_set = Subset(full_eval, val_idx)
        self.train_eval_set = Subset(full_eval, train_idx)
        self.test_set = CIFAR100(str(self.root), train=False, transform=eval_tf, download=False)
