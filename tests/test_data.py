"""Data modules: the digits split, synthetic data, ImageFolder and CIFAR-100 from local roots."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from vitexp.data.datamodules import (
    CIFAR100DataModule,
    DigitsDataModule,
    EpochSeededSampler,
    ImageFolderDataModule,
    SyntheticDataModule,
    train_sampler,
)

CFG32 = {"input_size": (3, 32, 32)}


def test_digits_split_is_fixed_stratified_and_disjoint():
    a, b = DigitsDataModule(data_config=CFG32), DigitsDataModule(data_config=CFG32)
    a.setup(), b.setup()
    sizes = {k: len(v) for k, v in a.split_indices.items()}
    assert sizes == {"train": 1078, "val": 359, "test": 360} and sum(sizes.values()) == 1797
    for k in a.split_indices:
        assert np.array_equal(a.split_indices[k], b.split_indices[k])
    all_idx = np.concatenate(list(a.split_indices.values()))
    assert len(np.unique(all_idx)) == 1797
    test_labels = torch.stack([a.test_set[i][1] for i in range(len(a.test_set))])
    assert torch.bincount(test_labels, minlength=10).min() >= 34  # stratified: ~36 per class
    x, y = next(iter(a.train_dataloader()))
    assert x.shape == (64, 3, 32, 32) and y.dtype == torch.long


def test_epoch_seeded_sampler_is_reproducible_per_epoch():
    s = EpochSeededSampler(range(50), seed=3)
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    s.set_epoch(0)
    assert list(s) == first and second != first and sorted(second) == list(range(50))


def test_epoch_orders_of_different_seeds_are_disjoint():
    """Seeds must not share an epoch's order: a table's std over seeds assumes independent runs."""
    orders = {}
    for seed in range(3):
        s = EpochSeededSampler(range(200), seed=seed)
        for epoch in range(10):
            s.set_epoch(epoch)
            orders.setdefault(tuple(s), []).append((seed, epoch))
    shared = [v for v in orders.values() if len(v) > 1]
    assert not shared, f"(seed, epoch) pairs drawing the same order: {shared}"


def test_ddp_sampler_keeps_the_seeds_apart():
    """Under DDP (2 ranks) the epoch orders of different seeds stay disjoint too, and the sampler is a
    DistributedSampler, which Lightning keeps instead of putting its ``seed + epoch`` one in."""
    orders = {}
    for seed in range(3):
        ranks = [train_sampler(range(200), seed, num_replicas=2, rank=r) for r in range(2)]
        assert all(isinstance(s, DistributedSampler) for s in ranks)
        for epoch in range(10):
            for s in ranks:
                s.set_epoch(epoch)
            shares = [list(s) for s in ranks]
            assert sorted(shares[0] + shares[1]) == list(range(200))
            orders.setdefault(tuple(shares[0] + shares[1]), []).append((seed, epoch))
    shared = [v for v in orders.values() if len(v) > 1]
    assert not shared, f"(seed, epoch) pairs drawing the same order: {shared}"
    assert isinstance(train_sampler(range(10), 1), EpochSeededSampler)


def test_the_training_loader_shards_by_the_process_group(monkeypatch):
    """Under an initialised process group of 2 the data module's training loader carries the seeded
    DistributedSampler, whose two ranks together draw the single-process order of that epoch."""
    import torch.distributed as dist

    single = train_sampler(range(40), 2)
    single.set_epoch(3)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    shares = []
    for rank in range(2):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        sampler = (
            DigitsDataModule(batch_size=8, data_config=CFG32, loader_seed=2)
            ._loader(range(40), train=True)
            .sampler
        )
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(3)
        shares.append(list(sampler))
    assert [i for pair in zip(*shares) for i in pair] == list(single)  # DistributedSampler deals rank by rank


def test_seed_zero_keeps_its_orders():
    """Seed 0 draws epoch e's order from generator seed e (the committed seed-0 runs stay valid)."""
    s = EpochSeededSampler(range(50), seed=0)
    s.set_epoch(1)
    assert list(s) == torch.randperm(50, generator=torch.Generator().manual_seed(1)).tolist()


def test_synthetic_is_deterministic_and_class_conditional():
    dm = SyntheticDataModule(num_classes=4, data_config=CFG32, noise=0.1)
    dm.setup()
    x, y = dm.train_set.tensors
    assert x.shape == (512, 3, 32, 32)
    means = torch.stack([x[y == c].mean(0) for c in range(4)])
    assert (means[0] - means[1]).abs().mean() > 0.1  # classes differ


def test_imagefolder_from_local_root(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(3):
                Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    dm = ImageFolderDataModule(
        root=str(tmp_path),
        num_classes=2,
        batch_size=4,
        num_workers=0,
        data_config={**CFG32, "interpolation": "bicubic", "crop_pct": 0.875},
    )
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32)
    assert len(dm.test_set) == 6  # val doubles as test
    bad = ImageFolderDataModule(root=str(tmp_path), num_classes=1000, data_config=CFG32)
    with pytest.raises(ValueError, match="2 class folders but data.num_classes=1000"):
        bad.setup()


def test_missing_roots_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "imagenet")):
        ImageFolderDataModule(root=str(tmp_path / "imagenet"), data_config=CFG32).setup()
    with pytest.raises(FileNotFoundError, match="cifar-100-python"):
        CIFAR100DataModule(root=str(tmp_path), data_config=CFG32).setup()


def test_randaugment_posterize_at_full_magnitude_gives_black_not_an_error():
    import timm.data.auto_augment as aa
    from PIL import Image

    from vitexp.data.datamodules import timm_transforms

    timm_transforms({**CFG32, "interpolation": "bicubic", "crop_pct": 0.875}, True, "rand-m9-mstd0.5-inc1")
    op = aa.AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)
    out = op(Image.new("RGB", (8, 8), (200, 120, 40)))
    assert out.getextrema() == ((0, 0), (0, 0), (0, 0))


def test_dinov2_images_are_prepared_at_the_built_resolution_with_dinov2s_crop(make_cfg):
    """timm's DINOv2 configs say 518 px; a model built at 224 px gets Resize 256 -> CenterCrop 224."""
    from vitexp.data.datamodules import timm_transforms
    from vitexp.training.build import build_backbone_and_method

    _, _, data_config = build_backbone_and_method(make_cfg(["backbone=dinov2_vits14", "data=synthetic"]))
    assert data_config["input_size"] == (3, 224, 224) and data_config["crop_pct"] == 0.875
    resize = timm_transforms(data_config, train=False).transforms[0]
    assert resize.size in (256, [256], (256,))


def test_a_ddp_strategy_on_one_device_keeps_the_seeded_order(tmp_path):
    """``trainer=ddp`` on a one-GPU node: Lightning runs a process group of one and puts its own
    ``seed + epoch`` DistributedSampler in place of any other; the data module gives it the seeded
    DistributedSampler, which it keeps, and which draws the single-process order of every epoch."""
    import lightning as L
    import torch.distributed as dist

    seen = []

    class Record(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            sampler = trainer.train_dataloader.sampler
            seen.append((sampler, list(sampler)))

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3 * 32 * 32, 10)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    dm = DigitsDataModule(batch_size=64, data_config=CFG32, loader_seed=2, num_workers=0)
    trainer = L.Trainer(
        strategy="ddp",
        devices=1,
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
        default_root_dir=tmp_path,
    )
    environ = dict(os.environ)  # Lightning sets MASTER_PORT, WORLD_SIZE, LOCAL_RANK ... for its group
    try:
        trainer.fit(Tiny(), datamodule=dm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()  # a later `vitexp-train` subprocess would otherwise think it is rank 0 of a group
        os.environ.update(environ)
    single = EpochSeededSampler(range(len(dm.train_set)), seed=2)
    assert len(seen) == 2
    for epoch, (sampler, order) in enumerate(seen):
        single.set_epoch(epoch)
        assert isinstance(sampler, DistributedSampler) and sampler.seed == 2 * 1_000_003
        assert order == list(single)
