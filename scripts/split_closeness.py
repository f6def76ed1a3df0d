"""How close the Fashion-MNIST tier's validation and test images are to its training images: for every
image of each split, the L2 distance (pixels scaled to [0, 1], the 28 × 28 originals) to its nearest
image of the training split the tier trains on (the 55,000 left after the fixed stratified 5,000 of
``conf/data/fashion_mnist.yaml``: ``val_size``, ``split_seed``), summarised by quantiles, by the share of
images under a few distances and by each class's median, and each split's images per class; and how
much of the 14 × 14 grid each class's garments cover (tokens of 2 × 2 original pixels with any non-zero
pixel, the 56-px grid's tokens after 2 × nearest upsampling) and the share of images covering more
tokens than BSPF-ViT keeps at keep 0.5 (98 of 196).

Why: a validation split carved from the training pool could hold near-copies of training images that
the test split lacks, which would reward a model that fits its training images more on validation than
on test (a split dependence of its paired differences that no seed averages out). Equal distributions
rule that out. Larger garments on one split would make a pruning method at a fixed token budget drop
more of their foreground there; equal coverage rules that out. Writes
``results/analysis/fmnist_split_closeness.json`` (atomically); about a minute on one CPU thread.

    python scripts/split_closeness.py [--root /usr/share/datasets/fashion-mnist] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from vitexp import PROJECT_ROOT
from vitexp.data.fashion_mnist import load_fashion_mnist, split_train_val
from vitexp.ledger import atomic_write_json

QUANTILES = (0.01, 0.05, 0.1, 0.25, 0.5)
UNDER = (1.0, 2.0, 3.0)
GRID14_PATCH = 2  # original pixels per token side on the 14 × 14 grid (28 px × 2 upsampling / 4-px patches)
GRID14_KEPT = 98  # tokens BSPF-ViT keeps at keep 0.5 on 196


def foreground_tokens(images: torch.Tensor, patch: int = GRID14_PATCH) -> np.ndarray:
    """Each image's count of grid tokens (``patch`` × ``patch`` original pixels) holding a non-zero pixel."""
    n, h, w = images.shape
    tiles = images.reshape(n, h // patch, patch, w // patch, patch).amax(dim=(2, 4))
    return (tiles > 0).sum(dim=(1, 2)).numpy()


def nearest(queries: torch.Tensor, pool: torch.Tensor, chunk: int = 500) -> np.ndarray:
    """Each query's L2 distance to its nearest pool image (both N × 784 in [0, 1])."""
    pool_sq = (pool * pool).sum(1)
    out = []
    for start in range(0, len(queries), chunk):
        q = queries[start : start + chunk]
        d2 = (q * q).sum(1, keepdim=True) - 2 * q @ pool.T + pool_sq
        out.append(d2.min(1).values.clamp_min(0).sqrt())
    return torch.cat(out).numpy()


def main() -> None:
    data_cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "data" / "fashion_mnist.yaml")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=data_cfg.root)
    parser.add_argument(
        "--out", default=str(PROJECT_ROOT / "results" / "analysis" / "fmnist_split_closeness.json")
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_fashion_mnist(args.root, data_cfg.package)
    images, labels = data["train"]
    train_idx, val_idx = split_train_val(labels, int(data_cfg.val_size), int(data_cfg.split_seed))
    flat = lambda x: x.reshape(len(x), -1).float() / 255  # noqa: E731
    pool = flat(images[train_idx])
    splits = {"val": (images[val_idx], labels[val_idx]), "test": data["test"]}
    report = {
        "pool": {"images": len(pool), "what": "the tier's training split (train minus the validation split)"},
        "distance": "L2 over 784 pixels scaled to [0, 1], to the nearest training image",
        "grid14_foreground_tokens": (
            f"tokens of the 14 x 14 grid ({GRID14_PATCH} x {GRID14_PATCH} original pixels) "
            f"holding a non-zero pixel, of 196; keep 0.5 keeps {GRID14_KEPT}"
        ),
    }
    for split, (x, y) in splits.items():
        d = nearest(flat(x), pool)
        report[split] = {
            "images": len(d),
            "quantiles": {str(q): round(float(np.quantile(d, q)), 4) for q in QUANTILES},
            "share_under": {str(t): round(float((d < t).mean()), 4) for t in UNDER},
            "per_class": np.bincount(y.numpy(), minlength=10).tolist(),
            "per_class_median": [round(float(np.median(d[y.numpy() == c])), 4) for c in range(10)],
        }
        tokens, labels_np = foreground_tokens(x), y.numpy()
        report[split]["grid14_foreground_tokens"] = {
            "per_class_mean": [round(float(tokens[labels_np == c].mean()), 2) for c in range(10)],
            f"per_class_share_over_{GRID14_KEPT}": [
                round(float((tokens[labels_np == c] > GRID14_KEPT).mean()), 4) for c in range(10)
            ],
        }
    atomic_write_json(Path(args.out), report)
    print(json.dumps({s: report[s]["quantiles"] for s in splits}))


if __name__ == "__main__":
    main()
