"""Which patch tokens form a chunk (``method.chunk_layout``).

- ``window`` (default): chunks are √Ω × √Ω windows of the patch grid, as in the Shifted Chunk
  Transformer that BSPF-ViT builds on. The patch tokens are put in window order once, before the
  first block (window by window in raster order of the windows, raster order inside a window), so
  a chunk is again Ω consecutive tokens. Pruning keeps each surviving token in its window, in
  order, so a later layer's chunks are the survivors of each window (Ω' = ⌈ρΩ⌉ tokens).
  Ω must be a square s² whose side s divides both sides of the grid (DeiT-S 14×14: Ω = 49, four
  7×7 windows; the micro ViT 8×8: Ω = 16, four 4×4 windows).
- ``raster``: chunks are Ω consecutive tokens in raster order (Ω = 49 on a 14×14 grid is 3.5 rows).

Both layouts run the same token counts through the same layers, so their MACs are identical; the
one-off reordering is a gather (no MACs).
"""
from __future__ import annotations

import math

import torch

CHUNK_LAYOUTS = ("window", "raster")


def chunk_count(num_patches: int, chunk_size: int | None) -> int:
    """C = N_p / Ω (one chunk when ``chunk_size`` is None); ValueError naming the valid sizes."""
    if chunk_size is None:
        return 1
    if num_patches % chunk_size:
        divisors = [d for d in range(1, num_patches + 1) if num_patches % d == 0]
        raise ValueError(f"method.chunk_size={chunk_size} does not divide the {num_patches} patch tokens; "
                         f"valid chunk sizes: {divisors} (or null for one chunk)")
    return num_patches // chunk_size


def window_side(grid: tuple[int, int], chunk_size: int | None) -> int:
    """The side s of the s×s windows of ``chunk_layout=window`` on a ``grid`` (H, W) of patches;
    ValueError naming the valid chunk sizes when Ω is not a square whose side divides H and W."""
    h, w = int(grid[0]), int(grid[1])
    if chunk_size is None:
        return 0  # one chunk: no windows
    side = math.isqrt(int(chunk_size))
    if side * side != chunk_size or h % side or w % side:
        valid = [s * s for s in range(1, min(h, w) + 1) if h % s == 0 and w % s == 0]
        raise ValueError(f"method.chunk_size={chunk_size}: chunk_layout=window needs Ω = s² with s dividing the "
                         f"{h}x{w} patch grid; valid chunk sizes: {valid} (or null for one chunk, or "
                         f"method.chunk_layout=raster)")
    return side


def check_layout(grid: tuple[int, int], chunk_size: int | None, layout: str) -> int:
    """Validate ``layout`` on ``grid``; return the chunk count C."""
    if layout not in CHUNK_LAYOUTS:
        raise ValueError(f"method.chunk_layout={layout!r}: valid layouts are {CHUNK_LAYOUTS}")
    if layout == "window":
        window_side(grid, chunk_size)
    return chunk_count(int(grid[0]) * int(grid[1]), chunk_size)


def window_order(grid: tuple[int, int], chunk_size: int | None) -> torch.Tensor | None:
    """Raster index of the patch token at each position of window order, or None when the order
    is the raster order itself (one chunk, or one window covering the grid)."""
    h, w = int(grid[0]), int(grid[1])
    side = window_side(grid, chunk_size)
    if side == 0 or (side == h and side == w):
        return None
    index = torch.arange(h * w).reshape(h // side, side, w // side, side)
    return index.permute(0, 2, 1, 3).reshape(-1)
