"""Where the tokens go (``vitexp-analyze tokens``): source maps of a token-reduction method (BSPF-ViT,
chunk-only, EViT, ToMe) on a ViT, from the decisions its own layers record.

Its reasoning: docs/commands.md, "vitexp/analysis/tokens.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from vitexp.methods.token_record import TokenDecision, recording_modules


@dataclass
class LayerMap:
    """Where each original patch is after reducing block ``block`` (B×Np tensors, raster patch order)."""

    block: int
    token: torch.Tensor  # long: the non-prefix token that stands for the patch, −1 once dropped
    kept: torch.Tensor  # bool: the patch's own token has survived every layer so far
    tokens_out: int
    chunks: int

    @property
    def fused(self) -> torch.Tensor:
        return (self.token >= 0) & ~self.kept

    @property
    def dropped(self) -> torch.Tensor:
        return self.token < 0


def _block_of(model: nn.Module) -> dict[int, int]:
    """id(module) -> index of the ViT block that holds it."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(
            f"vitexp-analyze tokens needs a ViT with .blocks; {type(model).__name__} has none "
            "(CaFormer's BSPF-ViT is not drawn)"
        )
    return {id(m): i for i, block in enumerate(blocks) for m in block.modules()}


@torch.no_grad()
def record_decisions(model: nn.Module, images: torch.Tensor) -> list[tuple[int, TokenDecision]]:
    """Run ``model`` (eval) on ``images`` with every recording layer on; (block index, decision)
    of each layer that reduced tokens, in forward order. The flags are off again afterwards."""
    block_of = _block_of(model)
    modules = recording_modules(model)
    for m in modules:
        m.record_decisions, m.decision = True, None
    try:
        model.eval()
        model(images)
    finally:
        for m in modules:
            m.record_decisions = False
    out = [(block_of.get(id(m), -1), m.decision) for m in modules if m.decision is not None]
    for m in modules:
        m.decision = None
    return out


def first_order(model: nn.Module) -> torch.Tensor | None:
    """Raster index of the patch at each token slot entering the first block (BSPF-ViT's window
    order), or None when that is the raster order."""
    window = getattr(model.blocks[0], "window_order", None)
    return None if window is None else window.order.detach().cpu()


def chunk_count(model: nn.Module) -> int:
    """C of a chunk-attention model (BSPF-ViT, chunk-only), 1 otherwise."""
    attn = getattr(model.blocks[0], "attn", None)
    return int(getattr(attn, "num_chunks", None) or 1)


def patch_chunks(num_patches: int, chunks: int, order: torch.Tensor | None) -> torch.Tensor:
    """(Np,) chunk of each raster patch: its first slot s(p) // (Np / C)."""
    slot = _first_slots(num_patches, order)
    return slot // max(1, num_patches // chunks)


def _first_slots(num_patches: int, order: torch.Tensor | None) -> torch.Tensor:
    if order is None:
        return torch.arange(num_patches)
    if order.numel() != num_patches:
        raise ValueError(f"the first block's token order has {order.numel()} slots for {num_patches} patches")
    return torch.argsort(order)


def source_maps(
    decisions: list[tuple[int, TokenDecision]], num_patches: int, order: torch.Tensor | None = None
) -> list[LayerMap]:
    """Compose the layers' decisions into one :class:`LayerMap` per reducing layer (module docstring)."""
    if not decisions:
        return []
    batch = decisions[0][1].target.shape[0]
    token = (
        _first_slots(num_patches, order).to(decisions[0][1].target.device).expand(batch, num_patches).clone()
    )
    kept = torch.ones_like(token, dtype=torch.bool)
    maps, tokens_in = [], num_patches
    for block, d in decisions:
        if d.target.shape[1] != tokens_in:
            raise ValueError(
                f"block {block} decided about {d.target.shape[1]} tokens, but {tokens_in} enter it: "
                "a reducing layer's decision is missing"
            )
        tokens_in = int(d.tokens_out)
        alive = token >= 0
        index = token.clamp(min=0)
        kept = kept & alive & d.kept.gather(1, index)
        token = torch.where(alive, d.target.gather(1, index), torch.full_like(token, -1))
        maps.append(LayerMap(block, token, kept, int(d.tokens_out), int(d.chunks)))
    return maps


def layer_counts(maps: list[LayerMap]) -> list[dict[str, Any]]:
    """Per reducing layer, the mean over images of kept, fused and dropped patches and of tokens left."""
    return [
        {
            "block": m.block,
            "tokens_out": m.tokens_out,
            "kept": float(m.kept.sum(1).float().mean()),
            "fused": float(m.fused.sum(1).float().mean()),
            "dropped": float(m.dropped.sum(1).float().mean()),
        }
        for m in maps
    ]


def patch_grid(model: nn.Module) -> tuple[int, int]:
    """The (rows, columns) grid of the model's patch tokens."""
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is None:
        raise TypeError(
            f"{type(model).__name__} has no patch_embed.grid_size: cannot place its patches on a grid"
        )
    return int(grid[0]), int(grid[1])
