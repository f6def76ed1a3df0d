"""The PNG of ``vitexp-analyze tokens`` for one image: the input, then one panel per reducing layer
(vitexp/analysis/tokens.py computes the maps).

Its reasoning: docs/commands.md, "vitexp/analysis/token_plots.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from vitexp.analysis import save_png
from vitexp.analysis.tokens import LayerMap

LEGEND = (
    "clear: kept; red, cross-hatched: dropped{chunks}\ntinted and hatched: fused into the token of that"
    " colour (outlined: that token's own patch, if it has one)"
)
#: A dropped patch: a red cover with a cross-hatch (no dark fill: see the module docstring).
DROPPED = (0.85, 0.1, 0.1)


def display_image(image: torch.Tensor) -> np.ndarray:
    """(3, H, W) normalised tensor -> (H, W, 3) in [0, 1] (min–max over the image)."""
    img = image.detach().float().cpu()
    img = (img - img.min()) / (img.max() - img.min()).clamp(min=1e-12)
    return img.permute(1, 2, 0).numpy()


def _chunk_edges(ax, chunks: np.ndarray, cell_h: float, cell_w: float) -> None:
    """White lines between neighbouring patches of different chunks."""
    rows, cols = chunks.shape
    for r in range(rows):
        for c in range(cols):
            if c + 1 < cols and chunks[r, c] != chunks[r, c + 1]:
                ax.plot([(c + 1) * cell_w] * 2, [r * cell_h, (r + 1) * cell_h], color="white", lw=1.6)
            if r + 1 < rows and chunks[r, c] != chunks[r + 1, c]:
                ax.plot([c * cell_w, (c + 1) * cell_w], [(r + 1) * cell_h] * 2, color="white", lw=1.6)


def _panel(
    ax,
    img: np.ndarray,
    grid: tuple[int, int],
    token: np.ndarray | None,
    kept: np.ndarray | None,
    chunks: np.ndarray | None,
    title: str,
) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows, cols = grid
    h, w = img.shape[:2]
    cell_h, cell_w = h / rows, w / cols
    ax.imshow(img, extent=(0, w, h, 0), interpolation="nearest")
    if token is not None:
        # no greys (they read as image content) and no reds (they read as dropped)
        palette = [
            c
            for c in plt.get_cmap("tab20").colors
            if max(c) - min(c) > 0.1 and not (c[0] > 0.8 and c[1] < 0.65 and c[2] < 0.65)
        ]
        overlay = np.zeros((rows, cols, 4))
        anchored = {}
        for r in range(rows):
            for c in range(cols):
                t = int(token[r, c])
                cell = (c * cell_w, r * cell_h)
                if t < 0:
                    overlay[r, c] = (*DROPPED, 0.45)
                    ax.add_patch(
                        Rectangle(cell, cell_w, cell_h, fill=False, hatch="xxx", edgecolor=DROPPED, lw=0.0)
                    )
                elif kept[r, c]:
                    anchored[t] = (r, c)
                else:
                    overlay[r, c] = (*palette[t % len(palette)], 0.55)
                    ax.add_patch(
                        Rectangle(cell, cell_w, cell_h, fill=False, hatch="///", edgecolor="white", lw=0.0)
                    )
        ax.imshow(overlay, extent=(0, w, h, 0), interpolation="nearest")
        absorbing = {int(t) for t in np.unique(token[(token >= 0) & ~kept])}
        for t in sorted(absorbing & anchored.keys()):
            r, c = anchored[t]
            ax.add_patch(
                Rectangle(
                    (c * cell_w, r * cell_h),
                    cell_w,
                    cell_h,
                    fill=False,
                    edgecolor=palette[t % len(palette)],
                    lw=2.0,
                )
            )
    if chunks is not None:
        _chunk_edges(ax, chunks, cell_h, cell_w)
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=7)


def draw_token_maps(
    image: torch.Tensor,
    maps: Sequence[LayerMap],
    index: int,
    grid: tuple[int, int],
    chunks: torch.Tensor | None,
    out: Path,
    title: str,
) -> Path:
    """Write the PNG of image ``index`` of the batch the ``maps`` describe; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img = display_image(image)
    chunk_grid = None if chunks is None or len(chunks.unique()) < 2 else chunks.reshape(grid).numpy()
    panels = 1 + len(maps)
    fig, axes = plt.subplots(
        1, panels, figsize=(max(2.0 * panels, 5.0), 2.9), squeeze=False, layout="constrained"
    )
    _panel(
        axes[0][0],
        img,
        grid,
        None,
        None,
        chunk_grid,
        "input" + (" + chunks" if chunk_grid is not None else ""),
    )
    for ax, m in zip(axes[0][1:], maps):
        token = m.token[index].reshape(grid).cpu().numpy()
        kept = m.kept[index].reshape(grid).cpu().numpy()
        fused, dropped = int(m.fused[index].sum()), int(m.dropped[index].sum())
        _panel(
            ax,
            img,
            grid,
            token,
            kept,
            chunk_grid,
            f"block {m.block}: {m.tokens_out} tokens\nkept {int(kept.sum())}, fused {fused}, dropped"
            f" {dropped}",
        )
    legend = LEGEND.format(chunks="; white lines: chunks" if chunk_grid is not None else "")
    return save_png(fig, out, f"{title}\n{legend}")
