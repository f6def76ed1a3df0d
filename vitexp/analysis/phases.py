"""RAPTOR's phases of a ViT (``vitexp-analyze phases``): the layer distance matrix over N images
and its contiguous max-cut partitions (vitexp/methods/raptor/ holds the definitions).

The figure is the matrix as a heatmap (layers numbered from 1, as RAPTOR writes its phases) with
the free partition at threshold f outlined, and one line per block budget k listing its phases.
The free partition's stopping rule (split while the best cut takes more than f of the segment's
weight) is vitexp's; RAPTOR chose its thresholds by hand per k. The per-budget lines (``--blocks``)
are the partitions a run with ``budget.k`` uses, and reproduce RAPTOR's on DINOv2-B-like matrices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch.nn as nn

from vitexp.ledger import atomic_write
from vitexp.methods.raptor import distance_matrix_from_data, max_cut_phases, phases_for_blocks


def one_based(phases: list[list[int]]) -> str:
    """[[0..6], [7..11]] -> "[1-7][8-12]" (RAPTOR's notation)."""
    return "".join(f"[{p[0] + 1}-{p[-1] + 1}]" for p in phases)


def phase_report(
    model: nn.Module, loader, images: int, f: float, blocks: Iterable[int], out: Path, min_size: int = 2
) -> dict[str, Any]:
    """Distance matrix, free phases at ``f`` and phases for each feasible budget; writes ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    distance = distance_matrix_from_data(model, loader, images)
    depth = distance.shape[0]
    free = max_cut_phases(distance, f=f, min_size=min_size)
    per_k = {
        int(k): phases_for_blocks(distance, int(k), min_size) for k in blocks if int(k) * min_size <= depth
    }

    fig, ax = plt.subplots(figsize=(5.5, 5.0))
    im = ax.imshow(distance.numpy(), cmap="viridis")
    fig.colorbar(im, ax=ax, fraction=0.046, label="Σ over {CLS, mean patch} of 1 − cos")
    for p in free:
        ax.add_patch(Rectangle((p[0] - 0.5, p[0] - 0.5), len(p), len(p), fill=False, edgecolor="red", lw=2))
    ticks = list(range(depth))
    ax.set_xticks(ticks, [str(t + 1) for t in ticks])
    ax.set_yticks(ticks, [str(t + 1) for t in ticks])
    ax.set_xlabel("layer")
    ax.set_ylabel("layer")
    lines = [f"f={f}: {one_based(free)}"] + [f"k={k}: {one_based(p)}" for k, p in per_k.items()]
    ax.set_title("layer distance, phases (red)\n" + "; ".join(lines), fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return {
        "images": images,
        "f": f,
        "phases_free": free,
        "phases_by_blocks": {str(k): p for k, p in per_k.items()},
        "phases_text": lines,
        "distance_matrix": [[round(float(v), 6) for v in row] for row in distance],
    }
