"""The heads of a SAPER run (``vitexp-analyze heads``): the layers × heads grid of the head scores with the
kept heads marked, beside the same grid coloured by the head clusters of ``vitexp-analyze clusters``
(vitexp/analysis/heads.py) for the run's unpruned backbone.

Its reasoning: docs/reading-saper.md, "vitexp/analysis/head_grid.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from vitexp.analysis import save_png


def kept_mask(kept_heads: Sequence[Sequence[int]], heads: int) -> np.ndarray:
    """(layers, heads) bool mask of ``kept_heads`` (per layer, the indices of the heads kept)."""
    mask = np.zeros((len(kept_heads), heads), dtype=bool)
    for layer, kept in enumerate(kept_heads):
        bad = [h for h in kept if not 0 <= int(h) < heads]
        if bad:
            raise ValueError(f"kept_heads: layer {layer} keeps heads {bad}, outside 0..{heads - 1}")
        mask[layer, [int(h) for h in kept]] = True
    return mask


def checkpoint_scores(path: Path | None) -> torch.Tensor | None:
    """The head scores saved in a SAPER run's Lightning checkpoint (flat, layer-major), or None
    when there is no such file or key."""
    if path is None or not Path(path).is_file():
        return None
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    keys = [k for k in state if k.endswith("selector.scores")]
    return state[keys[0]].detach().float() if keys else None


def marked_cells(ax) -> list[tuple[int, int]]:
    """(layer, head) of every cell outlined on ``ax`` (the rectangles :func:`draw_head_grid` adds)."""
    cells = []
    for patch in ax.patches:
        x, y = patch.get_xy()
        cells.append((int(round(y + 0.5)), int(round(x + 0.5))))
    return sorted(cells)


def _grid(
    ax, values: np.ndarray, mask: np.ndarray, cmap, title: str, vmin=None, vmax=None, label: bool = True
):
    from matplotlib.patches import Rectangle

    im = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="equal")
    layers, heads = mask.shape
    for layer, head in zip(*np.nonzero(mask)):
        ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", lw=2.5))
    if label:
        for layer in range(layers):
            for head in range(heads):
                bright = float(im.norm(values[layer, head])) > 0.6  # dark text on the bright end of viridis
                ax.text(
                    head,
                    layer,
                    f"{values[layer, head]:.2g}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="black" if bright else "white",
                )
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=8)
    return im


def draw_head_grid(
    kept_heads: Sequence[Sequence[int]],
    heads: int,
    scores: torch.Tensor | None,
    clusters: Sequence[int] | None,
    out: Path,
    title: str,
) -> dict[str, Any]:
    """Write the PNG: scores (or the kept heads alone) and, when given, the cluster labels
    (layer-major, one per head), each grid with the kept heads outlined. Returns the outlined
    cells of each grid, read back from the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mask = kept_mask(kept_heads, heads)
    layers = mask.shape[0]
    panels = 1 + (clusters is not None)
    fig, axes = plt.subplots(
        1, panels, figsize=(0.7 * heads * panels + 2.5, 0.6 * layers + 1.6), squeeze=False
    )
    if scores is not None:
        if scores.numel() != mask.size:
            raise ValueError(f"{scores.numel()} head scores for {layers} layers x {heads} heads")
        values = scores.reshape(layers, heads).numpy()
        im = _grid(axes[0][0], values, mask, "viridis", "head scores; kept heads outlined")
        fig.colorbar(im, ax=axes[0][0], fraction=0.046, label="score")
    else:
        _grid(
            axes[0][0],
            mask.astype(float),
            mask,
            "Greys",
            "kept heads outlined (no checkpoint: scores unknown)",
            vmin=0,
            vmax=3,
            label=False,
        )
    marked = {"scores": marked_cells(axes[0][0])}
    if clusters is not None:
        labels = np.asarray(clusters).reshape(layers, heads)
        n = int(labels.max()) + 1
        _grid(
            axes[0][1],
            labels.astype(float),
            mask,
            plt.get_cmap("tab10", max(n, 2)),
            f"spectral clusters (k={n}) of the unpruned backbone",
            vmin=-0.5,
            vmax=max(n, 2) - 0.5,
        )
        marked["clusters"] = marked_cells(axes[0][1])
    save_png(fig, out, title)
    return marked
