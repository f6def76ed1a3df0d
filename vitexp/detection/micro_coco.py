"""A micro COCO that a 2-core CPU can train on: real Fashion-MNIST items (or scikit-learn's digits when the
Debian package ``dataset-fashion-mnist`` is absent) composed onto square canvases, with their boxes and
instance masks, written in COCO 2017's layout so that ``data=coco`` reads it.

Its reasoning: docs/full-size.md, "vitexp/detection/micro_coco.py".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
SOURCES = ("auto", "fashion_mnist", "digits")


def load_items(
    source: str = "auto", split: str = "train"
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...], str]:
    """(uint8 images (N, h, w), labels (N,), class names, source used) for ``split`` train | test."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r}: valid sources are {SOURCES}")
    from vitexp.data.fashion_mnist import FASHION_MNIST_FILES, FASHION_MNIST_ROOT, load_fashion_mnist

    root = Path(FASHION_MNIST_ROOT)
    present = all((root / f).is_file() for pair in FASHION_MNIST_FILES.values() for f in pair)
    if source == "fashion_mnist" or (source == "auto" and present):
        images, labels = load_fashion_mnist(root)[
            "train" if split == "train" else "test"
        ]  # names the package when missing
        return images.numpy(), labels.numpy(), FASHION_MNIST_CLASSES, "fashion_mnist"
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(images))  # a fixed train/test split of the 1,797 digits
    cut = int(0.8 * len(images))
    idx = order[:cut] if split == "train" else order[cut:]
    images = np.kron(
        images[idx], np.ones((1, 3, 3), dtype=np.uint8)
    )  # 8x8 -> 24x24, as items of similar size
    return images, digits.target[idx].astype(np.int64), tuple(str(i) for i in range(10)), "digits"


def _resize(item: np.ndarray, scale: float) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    h, w = item.shape
    size = (max(4, round(h * scale)), max(4, round(w * scale)))
    t = torch.from_numpy(item.astype(np.float32))[None, None]
    return (
        F.interpolate(t, size=size, mode="bilinear", align_corners=False)[0, 0]
        .round()
        .clamp(0, 255)
        .numpy()
        .astype(np.uint8)
    )


def _place(rng: np.random.Generator, size: int, h: int, w: int, boxes: list[tuple[int, int, int, int]]):
    """(x0, y0) of an h×w patch whose box overlaps none of ``boxes`` (50 tries), or None."""
    for _try in range(50):
        y0, x0 = int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1))
        if all(x0 >= b[2] or x0 + w <= b[0] or y0 >= b[3] or y0 + h <= b[1] for b in boxes):
            return x0, y0
    return None


def _instance(label: int, mask: np.ndarray, crowd: bool = False) -> dict[str, Any]:
    ys, xs = np.nonzero(mask)
    bbox = (int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1))
    return {"label": label, "mask": mask, "bbox": bbox, "iscrowd": crowd}


def _crowd_group(
    items: np.ndarray, labels: np.ndarray, rng: np.random.Generator, size: int, scale: tuple[float, float]
) -> tuple[np.ndarray, int]:
    """A strip of 3 to 5 touching items of one class (module docstring) and that class."""
    label = int(labels[int(rng.integers(len(items)))])
    members = np.flatnonzero(labels == label)
    factor = float(rng.uniform(0.6, 0.8)) * scale[0]
    parts = [
        _resize(items[int(members[rng.integers(len(members))])], factor)
        for _ in range(int(rng.integers(3, 6)))
    ]
    h = max(p.shape[0] for p in parts)
    steps = [0] + [
        p.shape[1] - p.shape[1] // 3 for p in parts[:-1]
    ]  # each overlaps the one before by a third
    starts = np.cumsum(steps)
    strip = np.zeros((h, int(starts[-1]) + parts[-1].shape[1]), dtype=np.uint8)
    for x, p in zip(starts, parts):
        strip[: p.shape[0], x : x + p.shape[1]] = np.maximum(strip[: p.shape[0], x : x + p.shape[1]], p)
    return strip, label


def compose_canvas(
    items: np.ndarray,
    labels: np.ndarray,
    rng: np.random.Generator,
    size: int,
    max_items: int,
    scale: tuple[float, float],
    threshold: int,
    crowd: float = 0.0,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """One canvas (uint8 size×size) and its instances: ``label``, ``mask`` (bool size×size), ``bbox``
    (x, y, w, h), ``iscrowd``; with probability ``crowd``, a crowd region besides (module docstring)."""
    canvas = np.zeros((size, size), dtype=np.uint8)
    boxes: list[tuple[int, int, int, int]] = []  # x0, y0, x1, y1 of the pasted patches
    instances = []

    def paste(patch: np.ndarray, label: int, is_crowd: bool) -> None:
        h, w = patch.shape
        if h >= size or w >= size:
            return
        at = _place(rng, size, h, w, boxes)
        if at is None:
            return
        x0, y0 = at
        mask = np.zeros((size, size), dtype=bool)
        mask[y0 : y0 + h, x0 : x0 + w] = patch > threshold
        if not mask.any():
            return
        canvas[y0 : y0 + h, x0 : x0 + w] = np.maximum(canvas[y0 : y0 + h, x0 : x0 + w], patch)
        boxes.append((x0, y0, x0 + w, y0 + h))
        instances.append(_instance(label, mask, is_crowd))

    for _ in range(int(rng.integers(1, max_items + 1))):
        i = int(rng.integers(len(items)))
        paste(_resize(items[i], float(rng.uniform(*scale))), int(labels[i]), False)
    if (
        crowd > 0 and rng.random() < crowd
    ):  # no draw at all without crowds: the crowd-free dataset is unchanged
        paste(*_crowd_group(items, labels, rng, size, scale), True)
    return canvas, instances


def uncompressed_rle(mask: np.ndarray) -> dict[str, Any]:
    """COCO's uncompressed RLE of a boolean mask (the form COCO gives crowd regions): run lengths in
    column-major order, starting with a run of zeros."""
    flat = np.asfortranarray(mask).ravel(order="F").astype(np.int8)
    edges = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], edges, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat.size and flat[0]:
        counts = [0] + counts
    return {"counts": [int(c) for c in counts], "size": [int(mask.shape[0]), int(mask.shape[1])]}


def _write_split(
    out: Path,
    split: str,
    n_images: int,
    items,
    labels,
    classes,
    rng,
    size: int,
    max_items: int,
    scale,
    threshold: int,
    crowd: float = 0.0,
) -> dict[str, int]:
    from PIL import Image
    from pycocotools import mask as mask_utils

    folder = out / f"{split}2017"
    folder.mkdir(parents=True)
    images, annotations = [], []
    for image_id in range(1, n_images + 1):
        canvas, instances = compose_canvas(items, labels, rng, size, max_items, scale, threshold, crowd)
        file_name = f"{image_id:06d}.png"
        Image.fromarray(np.repeat(canvas[..., None], 3, axis=2)).save(folder / file_name)
        images.append({"id": image_id, "file_name": file_name, "height": size, "width": size})
        for inst in instances:
            if inst["iscrowd"]:
                rle = uncompressed_rle(inst["mask"])
            else:
                rle = mask_utils.encode(np.asfortranarray(inst["mask"].astype(np.uint8)))
                rle["counts"] = rle["counts"].decode("ascii")
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": inst["label"] + 1,
                    "bbox": list(inst["bbox"]),
                    "area": int(inst["mask"].sum()),
                    "iscrowd": int(inst["iscrowd"]),
                    "segmentation": rle,
                }
            )
    coco = {
        "info": {"description": f"vitexp micro COCO ({split})"},
        "images": images,
        "annotations": annotations,
        "categories": [
            {"id": i + 1, "name": name, "supercategory": "item"} for i, name in enumerate(classes)
        ],
    }
    (out / "annotations").mkdir(exist_ok=True)
    (out / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(coco))
    return {
        "images": len(images),
        "instances": len(annotations),
        "crowd_regions": sum(a["iscrowd"] for a in annotations),
    }


def make_micro_coco(
    out: str | Path,
    n_train: int = 512,
    n_val: int = 128,
    size: int = 128,
    max_items: int = 4,
    scale: Sequence[float] = (1.0, 2.0),
    threshold: int = 40,
    seed: int = 0,
    source: str = "auto",
    overwrite: bool = False,
    crowd: float = 0.0,
) -> dict[str, Any]:
    """Write ``out/{train2017,val2017}/*.png`` and ``out/annotations/instances_{train,val}2017.json``;
    returns a summary (counts, source, parameters). ``crowd``: the probability that a canvas also
    holds a crowd region (module docstring)."""
    out = Path(out).expanduser()
    if not 64 <= size <= 1024:
        raise ValueError(f"size={size}: canvases must be 64 to 1024 px")
    if not 0.0 <= float(crowd) <= 1.0:
        raise ValueError(f"crowd={crowd}: the probability of a crowd region per canvas must be in [0, 1]")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    rng = np.random.default_rng(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        summary: dict[str, Any] = {
            "size": size,
            "max_items": max_items,
            "scale": list(scale),
            "threshold": threshold,
            "seed": seed,
            "crowd": float(crowd),
        }
        for split, n in (("train", n_train), ("val", n_val)):
            items, labels, classes, used = load_items(source, "train" if split == "train" else "test")
            summary[split] = _write_split(
                tmp,
                split,
                n,
                items,
                labels,
                classes,
                rng,
                size,
                max_items,
                tuple(scale),
                threshold,
                float(crowd),
            )
            summary["source"] = used
        (tmp / "micro_coco.json").write_text(json.dumps(summary, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def main(argv: list[str] | None = None) -> int:
    """``vitexp-data make-micro-coco --out DIR``: write the micro COCO; prints a JSON summary last."""
    import argparse

    parser = argparse.ArgumentParser(prog="vitexp-data", description="vitexp's dataset tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make-micro-coco", help=make_micro_coco.__doc__)
    p.add_argument("--out", required=True, help="folder to create (COCO 2017 layout)")
    p.add_argument("--train", type=int, default=512, help="training canvases")
    p.add_argument("--val", type=int, default=128, help="validation canvases (the test split)")
    p.add_argument("--size", type=int, default=128, help="canvas side in px")
    p.add_argument("--max-items", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", choices=SOURCES, default="auto")
    p.add_argument(
        "--crowd",
        type=float,
        default=0.0,
        help="probability that a canvas also holds a crowd region (iscrowd=1, uncompressed RLE)",
    )
    p.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        summary = make_micro_coco(
            args.out,
            args.train,
            args.val,
            args.size,
            args.max_items,
            seed=args.seed,
            source=args.source,
            overwrite=args.overwrite,
            crowd=args.crowd,
        )
    except (ValueError, FileExistsError, FileNotFoundError) as err:
        print(json.dumps({"status": "failed", "error": str(err)}))
        return 2
    print(json.dumps({"status": "completed", "out": str(args.out), **summary}))
    return 0


def main_exit() -> None:
    """Console entry point of ``vitexp-data``."""
    raise SystemExit(main())
