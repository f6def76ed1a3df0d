"""Interpretability of attention heads (SAPER's analyses): Laplace maps and head clustering.

Its reasoning: docs/reading-saper.md, "vitexp/analysis/heads.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from vitexp.ledger import atomic_write


@torch.no_grad()
def attention_maps(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Post-softmax attention of every block: (layers, B, heads, N, N)."""
    blocks = model.blocks
    inputs: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for b in blocks]
    try:
        model.eval()
        model.forward_features(images) if hasattr(model, "forward_features") else model(images)
    finally:
        for h in hooks:
            h.remove()
    maps = []
    for block, x in zip(blocks, inputs):
        attn = block.attn
        B, N, _ = x.shape
        q, k, _ = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = attn.q_norm(q), attn.k_norm(k)
        maps.append(((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1))
    return torch.stack(maps)


def normalized_laplacian(adjacency: torch.Tensor) -> torch.Tensor:
    """L = I − D^{−1/2} W D^{−1/2} of the symmetrised graph W = (A + Aᵀ)/2."""
    w = 0.5 * (adjacency + adjacency.transpose(-1, -2))
    d = w.sum(-1).clamp(min=1e-12).rsqrt()
    eye = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)
    return eye - d.unsqueeze(-1) * w * d.unsqueeze(-2)


def fix_eigenvector_signs(vecs: torch.Tensor) -> torch.Tensor:
    """Each column signed so that its largest-magnitude entry is positive."""
    idx = vecs.abs().argmax(dim=0, keepdim=True)
    return vecs * torch.sign(vecs.gather(0, idx))


def laplace_rgb(patch_attention: torch.Tensor, side: int) -> np.ndarray:
    """Eigenvectors 2–4 of the normalised Laplacian, signed (:func:`fix_eigenvector_signs`) and
    min–max scaled, as an (side, side, 3) image."""
    lap = normalized_laplacian(patch_attention.double())
    _, vecs = torch.linalg.eigh(lap)
    rgb = fix_eigenvector_signs(vecs[:, 1:4])
    lo, hi = rgb.min(0).values, rgb.max(0).values
    rgb = (rgb - lo) / (hi - lo).clamp(min=1e-12)
    return rgb.reshape(side, side, 3).float().numpy()


def laplace_grid(model: nn.Module, image: torch.Tensor, num_prefix: int, out: Path) -> dict[str, Any]:
    """Write the layers × heads PNG of Laplace maps for one image; returns summary numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    maps = attention_maps(model, image.unsqueeze(0))[:, 0]  # layers, heads, N, N
    L, H = maps.shape[:2]
    n_patch = maps.shape[-1] - num_prefix
    side = int(round(n_patch**0.5))
    fig, axes = plt.subplots(L, H, figsize=(1.2 * H + 1, 1.2 * L + 0.6), squeeze=False)
    min_eig = 1.0
    for l in range(L):
        for h in range(H):
            a = maps[l, h, num_prefix:, num_prefix:]
            min_eig = min(min_eig, float(torch.linalg.eigvalsh(normalized_laplacian(a.double())).min()))
            axes[l][h].imshow(laplace_rgb(a, side), interpolation="nearest")
            axes[l][h].set_xticks([])
            axes[l][h].set_yticks([])
            if l == 0:
                axes[l][h].set_title(f"head {h}", fontsize=7)
            if h == 0:
                axes[l][h].set_ylabel(f"layer {l}", fontsize=7)
    fig.suptitle(
        "Laplace maps: eigenvectors 2-4 of the normalised Laplacian of (A + A^T)/2 as RGB", fontsize=8
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return {"layers": L, "heads": H, "grid_side": side, "min_laplacian_eigenvalue": min_eig}


def davies_bouldin_precomputed(distance: np.ndarray, labels: np.ndarray) -> float:
    """Davies–Bouldin index from a dissimilarity matrix, each cluster's centroid replaced by its
    medoid: DB = mean_c max_{d≠c} (s_c + s_d) / M_cd (module docstring). Lower is better; 0 when
    every cluster is a point. Coinciding medoids (M_cd = 0) are skipped, as scikit-learn skips
    coinciding centroids."""
    clusters = np.unique(labels)
    medoids, spread = [], []
    for c in clusters:
        members = np.flatnonzero(labels == c)
        within = distance[np.ix_(members, members)]
        medoid = members[within.sum(1).argmin()]
        medoids.append(medoid)
        spread.append(distance[members, medoid].mean())
    spread = np.asarray(spread)
    between = distance[np.ix_(medoids, medoids)].astype(float)
    between[between == 0] = np.inf
    ratios = (spread[:, None] + spread[None, :]) / between
    np.fill_diagonal(ratios, -np.inf)
    return float(ratios.max(1).mean())


def cluster_heads(values: np.ndarray, n_clusters: int) -> dict[str, Any]:
    """Spectral clustering of heads (columns of ``values``, images × heads) on the affinity
    (1 + ρ)/2 of their Pearson correlation ρ, scored with the distance 1 − affinity."""
    from sklearn.cluster import SpectralClustering
    from sklearn.metrics import silhouette_score

    corr = np.nan_to_num(np.corrcoef(values.T), nan=0.0)
    np.fill_diagonal(corr, 1.0)
    affinity = (1.0 + corr) / 2.0
    labels = SpectralClustering(n_clusters=n_clusters, affinity="precomputed", random_state=0).fit_predict(
        affinity
    )
    distance = 1.0 - affinity
    return {
        "labels": labels,
        "correlation": corr,
        "silhouette": float(silhouette_score(distance, labels, metric="precomputed")),
        "davies_bouldin": davies_bouldin_precomputed(distance, labels),
    }


def cls_max_attention(
    model: nn.Module, images: torch.Tensor, num_prefix: int, batch_size: int = 64
) -> np.ndarray:
    """Per image and head, the maximal attention the CLS query pays to a patch token: an
    (images, layers × heads) array, heads in layer-major order (index = layer · H + head)."""
    from tqdm.auto import tqdm

    values = []
    for chunk in tqdm(
        images.split(batch_size),
        desc="head clusters: attention maps",
        unit="batch",
        leave=False,
        disable=None,
    ):
        maps = attention_maps(model, chunk)  # layers, B, heads, N, N
        cls_max = maps[:, :, :, 0, num_prefix:].amax(-1)  # layers, B, heads
        values.append(cls_max.permute(1, 0, 2).reshape(chunk.shape[0], -1))
    return torch.cat(values).double().numpy()


def head_clusters(
    model: nn.Module, images: torch.Tensor, num_prefix: int, n_clusters: int, out: Path, batch_size: int = 64
) -> dict[str, Any]:
    """Cluster heads by the correlation of their maximal CLS attention over images; heatmap PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = cls_max_attention(model, images, num_prefix, batch_size)
    clustering = cluster_heads(x, n_clusters)
    labels, corr = clustering["labels"], clustering["correlation"]
    order = np.argsort(labels, kind="stable")
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(corr[np.ix_(order, order)], cmap="RdBu_r", vmin=-1, vmax=1)
    fig.colorbar(im, ax=ax, label="Pearson correlation")
    ax.set_title(
        f"Heads ordered by spectral cluster (k={n_clusters}); max CLS attention, {x.shape[0]} images",
        fontsize=8,
    )
    ax.set_xlabel("head (layer-major index)")
    ax.set_ylabel("head")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return {
        "davies_bouldin": clustering["davies_bouldin"],
        "silhouette": clustering["silhouette"],
        "n_clusters": n_clusters,
        "images": int(x.shape[0]),
        "heads": int(x.shape[1]),
        "labels": labels.tolist(),
    }
