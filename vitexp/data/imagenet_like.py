"""A folder of ImageNet-like JPEGs for timing a data loader (``vitexp-bench bench.mode=loader``).

Its reasoning: docs/measurements.md, "vitexp/data/imagenet_like.py".
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: File name of the record that the folder is complete.
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class JpegSpec:
    """What the folder holds: ``classes`` class folders with ``train_per_class`` training and
    ``val_per_class`` validation images of ``width`` × ``height`` px, ``target_kb`` KB on average
    (JPEG ``quality``), drawn from ``seed``."""

    classes: int = 1000
    train_per_class: int = 3
    val_per_class: int = 0
    width: int = 500
    height: int = 375
    target_kb: float = 110.0
    quality: int = 90
    seed: int = 0

    def __post_init__(self):
        if min(self.classes, self.train_per_class, self.width, self.height) < 1 or self.val_per_class < 0:
            raise ValueError(f"every count and size of {self} must be at least 1 (val_per_class at least 0)")
        if not 1 <= self.quality <= 95:
            raise ValueError(f"quality={self.quality}: PIL's JPEG quality runs from 1 to 95")

    @property
    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def default_root(spec: JpegSpec) -> Path:
    """``$VITEXP_CACHE`` (default ``~/.cache/vitexp``) ``/imagenet_like/<spec key>``."""
    cache = Path(os.environ.get("VITEXP_CACHE") or Path.home() / ".cache" / "vitexp")
    return cache.expanduser() / "imagenet_like" / spec.key


def _octave_texture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Σ over octaves s = 32, 16, 8, 4, 2 of Gaussian noise at 1/s resolution upsampled bilinearly,
    amplitude ∝ s (a 1/f spectrum), per channel with a shared luminance part; std about 1."""
    from PIL import Image

    total = np.zeros((height, width, 3), np.float32)
    for s in (32, 16, 8, 4, 2):
        h, w = max(1, height // s), max(1, width // s)
        layer = rng.normal(0.0, 1.0, (h, w, 3)).astype(np.float32) * 0.5 + rng.normal(0.0, 1.0, (h, w, 1))
        up = np.stack(
            [
                np.asarray(Image.fromarray(layer[..., c]).resize((width, height), Image.BILINEAR))
                for c in range(3)
            ],
            axis=-1,
        )
        total += up * s
    return total / float(np.std(total) or 1.0)


def _picture(rng: np.random.Generator, tiles: np.ndarray, spec: JpegSpec, grain: float) -> np.ndarray:
    """One uint8 H×W×3 image (module docstring)."""
    from PIL import Image

    h, w = spec.height, spec.width
    canvas = np.empty((h, w, 3), np.float32)
    side = int(rng.integers(max(8, min(h, w) // 6), max(9, min(h, w) // 2)))
    for y in range(0, h, side):
        for x in range(0, w, side):
            tile = tiles[int(rng.integers(len(tiles)))]
            up = np.asarray(Image.fromarray(tile).resize((side, side), Image.BICUBIC), np.float32)[
                : h - y, : w - x
            ]
            background, tint = rng.uniform(0, 140, 3), rng.uniform(0.35, 1.0, 3)
            canvas[y : y + up.shape[0], x : x + up.shape[1]] = background + up[..., None] * tint
    canvas += 28.0 * _octave_texture(rng, h, w)
    canvas += rng.normal(0.0, grain, canvas.shape).astype(np.float32)
    return np.clip(canvas, 0, 255).astype(np.uint8)


def _jpeg(pixels: np.ndarray, quality: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=quality)
    return out.getvalue()


def _tiles(fashion_mnist_root: str | Path | None) -> np.ndarray:
    from vitexp.data.fashion_mnist import FASHION_MNIST_ROOT, load_fashion_mnist

    return load_fashion_mnist(fashion_mnist_root or FASHION_MNIST_ROOT)["train"][0].numpy()


def calibrate_grain(spec: JpegSpec, tiles: np.ndarray, probes: int = 6, steps: int = 8) -> float:
    """The grain std (0..80) whose ``probes`` images reach ``spec.target_kb`` on average (bisection;
    file size grows with the grain)."""
    lo, hi = 0.0, 80.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        rng = np.random.default_rng([spec.seed, 999_983])
        kb = np.mean([len(_jpeg(_picture(rng, tiles, spec, mid), spec.quality)) for _ in range(probes)]) / 1e3
        lo, hi = (mid, hi) if kb < spec.target_kb else (lo, mid)
    return (lo + hi) / 2


def ensure_jpegs(
    spec: JpegSpec,
    root: str | Path | None = None,
    fashion_mnist_root: str | Path | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """The folder of ``spec`` at ``root`` (default :func:`default_root`), generated unless its
    manifest names the same parameters; returns the manifest (``root``, the parameters, ``grain``,
    ``images``, ``mean_kb``, ``min_kb``, ``max_kb``)."""
    from tqdm.auto import tqdm

    from vitexp.ledger import atomic_write

    root = Path(root) if root is not None else default_root(spec)
    manifest_path = root / MANIFEST
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("spec") == asdict(spec):
            return {**manifest, "root": str(root)}
    tiles = _tiles(fashion_mnist_root)
    grain = calibrate_grain(spec, tiles)
    sizes = []
    jobs = [
        (split, c, i)
        for split, per in (("train", spec.train_per_class), ("val", spec.val_per_class))
        for c in range(spec.classes)
        for i in range(per)
    ]
    for n, (split, c, i) in enumerate(tqdm(jobs, desc="ImageNet-like JPEGs", disable=not progress or None)):
        rng = np.random.default_rng([spec.seed, n])
        data = _jpeg(_picture(rng, tiles, spec, grain), spec.quality)
        folder = root / split / f"c{c:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:03d}.JPEG").write_bytes(data)
        sizes.append(len(data) / 1e3)
    if not spec.val_per_class and not (root / "val").exists():
        (root / "val").symlink_to("train", target_is_directory=True)
    manifest = {
        "spec": asdict(spec),
        "grain": grain,
        "images": len(sizes),
        "mean_kb": float(np.mean(sizes)),
        "min_kb": float(np.min(sizes)),
        "max_kb": float(np.max(sizes)),
        "content": "Fashion-MNIST mosaic + 1/f octave texture + grain (vitexp.data.imagenet_like)",
    }
    atomic_write(manifest_path, json.dumps(manifest, indent=1))
    return {**manifest, "root": str(root)}
