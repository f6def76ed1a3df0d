"""Which patch tokens form a chunk (``method.chunk_layout``).

Its reasoning: docs/reading-bspf.md, "vitexp/methods/bspf/layout.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CHUNK_LAYOUTS = ("window", "raster")


def chunk_count(num_patches: int, chunk_size: int | None) -> int:
    """C = N_p / Ω (one chunk when ``chunk_size`` is None); ValueError naming the valid sizes."""
    if chunk_size is None:
        return 1
    if num_patches % chunk_size:
        divisors = [d for d in range(1, num_patches + 1) if num_patches % d == 0]
        raise ValueError(
            f"method.chunk_size={chunk_size} does not divide the {num_patches} patch tokens; "
            f"valid chunk sizes: {divisors} (or null for one chunk)"
        )
    return num_patches // chunk_size


def square_side(chunk_size: int) -> int:
    """The side s of a window of Ω = s² tokens; ValueError when Ω is not a square."""
    side = math.isqrt(int(chunk_size))
    if side * side != chunk_size:
        squares = [s * s for s in range(1, 9)]
        raise ValueError(
            f"method.chunk_size={chunk_size}: chunk_layout=window needs a square Ω = s² "
            f"({squares}, ...), or method.chunk_layout=raster"
        )
    return side


def window_side(grid: tuple[int, int], chunk_size: int | None) -> int:
    """The side s of the s×s windows of ``chunk_layout=window`` on a ``grid`` (H, W) of patches;
    ValueError naming the valid chunk sizes when Ω is not a square whose side divides H and W."""
    h, w = int(grid[0]), int(grid[1])
    if chunk_size is None:
        return 0  # one chunk: no windows
    side = math.isqrt(int(chunk_size))
    if side * side != chunk_size or h % side or w % side:
        valid = [s * s for s in range(1, min(h, w) + 1) if h % s == 0 and w % s == 0]
        raise ValueError(
            f"method.chunk_size={chunk_size}: chunk_layout=window needs Ω = s² with s dividing the "
            f"{h}x{w} patch grid; valid chunk sizes: {valid} (or null for one chunk, or "
            "method.chunk_layout=raster)"
        )
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


@dataclass(frozen=True)
class Chunks:
    """Chunks of ``length`` slots over a sequence of real tokens: chunk c holds ``counts[c]`` of them
    in its first slots, then empty ones (module docstring). The real tokens are numbered chunk by
    chunk; ``full`` chunks are the tiled case, where slot and token numbers coincide."""

    counts: tuple[int, ...]
    length: int

    @property
    def num(self) -> int:
        return len(self.counts)

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    @property
    def full(self) -> bool:
        return all(c == self.length for c in self.counts)

    def valid(self, device=None) -> torch.Tensor:
        """(C, L) bool: the slots that hold a token."""
        counts = torch.tensor(self.counts, device=device)
        return torch.arange(self.length, device=device) < counts[:, None]

    def slot_of_token(self, device=None) -> torch.Tensor:
        """(N,) flat slot c·L + j of each real token."""
        return torch.arange(self.num * self.length, device=device)[self.valid(device).flatten()]

    def token_of_slot(self, device=None) -> torch.Tensor:
        """(C·L,) the real token in each slot; N (one past the last token) in an empty slot."""
        out = torch.full((self.num * self.length,), self.tokens, dtype=torch.long, device=device)
        out[self.slot_of_token(device)] = torch.arange(self.tokens, device=device)
        return out


def one_chunk(tokens: int) -> Chunks:
    return Chunks((tokens,), tokens)


def padded_chunks(
    grid: tuple[int, int], chunk_size: int | None, layout: str
) -> tuple[Chunks, torch.Tensor | None, tuple[int, int]]:
    """(the chunks, the raster index of each real token in chunk order or None for raster order,
    the padded grid) of ``layout`` on ``grid`` (module docstring)."""
    if layout not in CHUNK_LAYOUTS:
        raise ValueError(f"method.chunk_layout={layout!r}: valid layouts are {CHUNK_LAYOUTS}")
    h, w = int(grid[0]), int(grid[1])
    n = h * w
    if chunk_size is None:
        return one_chunk(n), None, (h, w)
    if layout == "raster":
        c = -(-n // chunk_size)
        if c == 1:
            return one_chunk(n), None, (h, w)
        return Chunks(tuple([chunk_size] * (c - 1) + [n - (c - 1) * chunk_size]), chunk_size), None, (h, w)
    side = square_side(chunk_size)
    nh, nw = -(-h // side), -(-w // side)
    if nh * nw == 1:
        return one_chunk(n), None, (h, w)
    raster = torch.arange(n).reshape(h, w)
    windows = [
        raster[i * side : (i + 1) * side, j * side : (j + 1) * side].reshape(-1)
        for i in range(nh)
        for j in range(nw)
    ]
    order = torch.cat(windows)
    return Chunks(tuple(len(win) for win in windows), chunk_size), order, (nh * side, nw * side)
