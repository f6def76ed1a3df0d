"""Fashion-MNIST: the IDX reader against facts of the real files, the fixed split, batch preparation,
and the error that names the Debian package. Tests that read the files skip where the package
``dataset-fashion-mnist`` is not installed (.ci/run installs it)."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from vitexp.data.fashion_mnist import (
    FASHION_MNIST_FILES,
    FASHION_MNIST_ROOT,
    FashionMNISTDataModule,
    GreyBatchDataset,
    load_fashion_mnist,
)
from vitexp.data.idx import IMAGES_MAGIC, LABELS_MAGIC, parse_idx, read_idx

ROOT = Path(FASHION_MNIST_ROOT)
# VITEXP_REQUIRE_FASHION_MNIST (set by .ci/run): the tests run, and fail, without the files
requires_fashion_mnist = pytest.mark.skipif(
    not all((ROOT / f).is_file() for pair in FASHION_MNIST_FILES.values() for f in pair)
    and not os.environ.get("VITEXP_REQUIRE_FASHION_MNIST"),
    reason=(
        f"Fashion-MNIST not installed in {ROOT}: apt-get install -y dataset-fashion-mnist (.ci/run does it)"
    ),
)
CFG = {"input_size": (3, 32, 32), "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}

# Facts of the Fashion-MNIST files, read once by torchvision's MNIST reader
# (torchvision.datasets.mnist.read_image_file / read_label_file) on gunzipped copies.
TRAIN_FIRST_LABELS = [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
TEST_FIRST_LABELS = [9, 2, 1, 1, 6, 1, 4, 6, 5, 7]
TRAIN_IMAGE0_SUM, TRAIN_LAST_SUM, TRAIN_TOTAL_SUM = 76247, 16684, 3431114169
TEST_IMAGE0_SUM, TEST_TOTAL_SUM = 33456, 573469082


@requires_fashion_mnist
def test_idx_reader_matches_known_facts_of_the_files():
    labels = read_idx(ROOT / "train-labels-idx1-ubyte.gz", LABELS_MAGIC)
    images = read_idx(ROOT / "train-images-idx3-ubyte.gz", IMAGES_MAGIC)
    assert images.shape == (60000, 28, 28) and images.dtype == np.uint8 and labels.shape == (60000,)
    assert labels[:10].tolist() == TRAIN_FIRST_LABELS
    assert np.bincount(labels).tolist() == [6000] * 10
    assert int(images[0].sum(dtype=np.int64)) == TRAIN_IMAGE0_SUM
    assert int(images[-1].sum(dtype=np.int64)) == TRAIN_LAST_SUM
    assert int(images.sum(dtype=np.int64)) == TRAIN_TOTAL_SUM
    data = load_fashion_mnist(ROOT)
    x, y = data["test"]
    assert x.shape == (10000, 28, 28) and y.dtype == torch.long and y[:10].tolist() == TEST_FIRST_LABELS
    assert int(x[0].sum()) == TEST_IMAGE0_SUM and int(x.sum()) == TEST_TOTAL_SUM


def _idx_bytes(array: np.ndarray, dtype_code: int = 0x08) -> bytes:
    header = struct.pack(">HBB", 0, dtype_code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def test_idx_reader_round_trip_and_bad_files(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(_idx_bytes(arr)))
    assert np.array_equal(read_idx(path, IMAGES_MAGIC), arr)
    raw = tmp_path / "y-idx1-ubyte"
    raw.write_bytes(_idx_bytes(np.array([3, 1, 4], dtype=np.uint8)))
    assert read_idx(raw, LABELS_MAGIC).tolist() == [3, 1, 4]
    with pytest.raises(ValueError, match="expected 2051"):
        read_idx(raw, IMAGES_MAGIC)
    with pytest.raises(ValueError, match="only unsigned bytes"):
        parse_idx(_idx_bytes(arr, dtype_code=0x0D))
    with pytest.raises(ValueError, match=r"header says \(2, 3, 4\) = 24 bytes, the file holds 23"):
        parse_idx(_idx_bytes(arr)[:-1])
    with pytest.raises(ValueError, match="bad IDX magic"):
        parse_idx(b"\x01\x00\x08\x01" + bytes(8))


@requires_fashion_mnist
def test_split_is_fixed_stratified_and_the_test_set_is_whole():
    a, b = FashionMNISTDataModule(data_config=CFG), FashionMNISTDataModule(data_config=CFG)
    a.setup(), b.setup()
    assert (len(a.train_set), len(a.val_set), len(a.test_set), len(a.train_eval_set)) == (
        55000,
        5000,
        10000,
        55000,
    )
    assert np.array_equal(a.split_indices["val"], b.split_indices["val"])
    assert not set(a.split_indices["val"]) & set(a.split_indices["train"])
    assert torch.bincount(a.val_set.labels, minlength=10).tolist() == [500] * 10
    other = FashionMNISTDataModule(data_config=CFG, split_seed=1)
    other.setup()
    assert not np.array_equal(other.split_indices["val"], a.split_indices["val"])
    x, y = next(iter(a.train_dataloader()))
    assert x.shape == (128, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.long
    first = a.test_set.batch([0])[0][0]  # test image 0, unaugmented: 2 px zero border, then the image
    mean, std = torch.tensor(CFG["mean"]).view(3, 1, 1), torch.tensor(CFG["std"]).view(3, 1, 1)
    pixels = first * std + mean
    assert torch.allclose(pixels[:, :2], torch.zeros(3, 2, 32), atol=1e-6)
    assert float(pixels[0, 2:30, 2:30].sum() * 255) == pytest.approx(TEST_IMAGE0_SUM, rel=1e-5)
    assert torch.allclose(pixels[0], pixels[2], atol=1e-5)  # grey repeated to 3 channels


def test_batches_upscale_pad_flip_and_translate_without_losing_pixels():
    g = torch.Generator().manual_seed(0)
    imgs = torch.zeros(64, 28, 28, dtype=torch.uint8)
    imgs[:, 4:24, 4:20] = torch.randint(1, 255, (64, 20, 16), generator=g, dtype=torch.uint8)
    ident = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
    x, _ = GreyBatchDataset(imgs, torch.zeros(64), 64, **ident).batch(range(64))
    assert x.shape == (64, 3, 64, 64)  # 28 -> x2 nearest = 56, then 4 px of zeros each side
    assert torch.equal(x[:, 0, 4:60:2, 4:60:2] * 255, imgs.float()) and x[:, :, :4].abs().sum() == 0
    torch.manual_seed(0)
    aug, _ = GreyBatchDataset(imgs, torch.zeros(64), 28, translate=2, flip=True, **ident).batch(range(64))
    out = (aug[:, 0] * 255).round().to(torch.uint8)
    moved = 0
    for img, o in zip(imgs, out):
        candidates = [
            torch.roll(src, (dy, dx), (0, 1))
            for src in (img, img.flip(-1))
            for dy in range(-2, 3)
            for dx in range(-2, 3)
        ]
        assert any(torch.equal(o, c) for c in candidates)  # a flip and a shift, nothing else
        moved += not torch.equal(o, img)
    assert moved > 48  # 49 of the 50 (flip, shift) draws change the image


def test_missing_root_names_the_package_and_command(tmp_path, make_cfg):
    with pytest.raises(
        FileNotFoundError, match="dataset-fashion-mnist.*apt-get install -y dataset-fashion-mnist"
    ):
        FashionMNISTDataModule(root=str(tmp_path), data_config=CFG).setup()
    from vitexp.config.composition import ConfigError
    from vitexp.training.resolve import validate

    cfg = make_cfg(["data=fashion_mnist", f"data.root={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="apt-get install -y dataset-fashion-mnist"):
        validate(cfg)


# ~100 s under this machine's contention (two model builds, FLOPs counts, 70k images loaded twice)
@pytest.mark.slow
@requires_fashion_mnist
def test_pretrain_then_a_seeded_method_row_from_its_weights(make_cfg, results_dir, tmp_path):
    """The tier's chain on real data, one batch each: the vit_micro baseline, then BSPF from its weights."""
    from conftest import QUIET, ledger_entries

    from vitexp.commands.train import train

    quick = QUIET + ["trainer.fast_dev_run=true", "eval.throughput=false"]
    train(make_cfg(quick + ["experiment=fmnist_vit_micro_baseline"], output_dir=tmp_path / "pre"))
    cfg = make_cfg(quick + ["experiment=fmnist_bspf_vit_micro", "seed=1"], output_dir=tmp_path / "bspf")
    assert cfg.backbone.pretrained == "run:fmnist_vit_micro_baseline" and cfg.data.name == "fashion_mnist"
    train(cfg)
    pre, bspf = sorted(ledger_entries(results_dir), key=lambda e: e["started"])
    assert pre["status"] == bspf["status"] == "completed" and bspf["config"]["seed"] == 1
    assert bspf["protocol"]["resolution"] == 32 and bspf["metrics"]["gmacs"] < pre["metrics"]["gmacs"]
