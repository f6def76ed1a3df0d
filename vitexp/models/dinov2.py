"""DINOv2 hub checkpoints (``dinov2_vit*14[_reg4]_pretrain.pth``, the files ``torch.hub.load(
"facebookresearch/dinov2", ...)`` loads) in timm's DINOv2 ViTs.

Its reasoning: docs/reading-backbones.md, "vitexp/models/dinov2.py".
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F


def is_hub_checkpoint(state: Mapping[str, torch.Tensor]) -> bool:
    """A DINOv2 hub state dict: its own keys (``mask_token``, ``blocks.0.ls1.gamma``), not timm's."""
    return "mask_token" in state and "pos_embed" in state and "reg_token" not in state


def hub_pos_embed(pos_embed: torch.Tensor, grid: tuple[int, int], registers: bool) -> torch.Tensor:
    """The hub model's ``interpolate_pos_encoding``: the checkpoint's (1, 1 + M², D) table (CLS
    first) on an M×M grid -> (1, 1 + gh·gw, D) for a gh×gw patch grid, by the rule of the hub's
    builder with or without registers (module docstring). Returned in the table's dtype."""
    n = pos_embed.shape[1] - 1
    m = int(math.sqrt(n))
    if m * m != n:
        raise ValueError(f"a DINOv2 position table of {n} patch positions is not a square grid")
    gh, gw = grid
    if (gh, gw) == (m, m):
        return pos_embed
    dim = pos_embed.shape[-1]
    table = pos_embed.float()
    patches = table[:, 1:].reshape(1, m, m, dim).permute(0, 3, 1, 2)
    if registers:
        patches = F.interpolate(patches, size=(gh, gw), mode="bicubic", antialias=True)
    else:
        patches = F.interpolate(
            patches, scale_factor=((gh + 0.1) / m, (gw + 0.1) / m), mode="bicubic", antialias=False
        )
    if patches.shape[-2:] != (gh, gw):
        raise ValueError(
            f"DINOv2's interpolation of the {m}x{m} table gave {tuple(patches.shape[-2:])}, not {grid}"
        )
    patches = patches.permute(0, 2, 3, 1).reshape(1, gh * gw, dim)
    return torch.cat([table[:, :1], patches], dim=1).to(pos_embed.dtype)


@torch.no_grad()
def load_hub_pos_embed(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Replace the position table timm resampled at load by the hub's interpolation of
    ``state["pos_embed"]`` to the model's grid (a no-op on the checkpoint's own grid).
    A timm model with ``no_embed_class`` (the ``*_reg4_dinov2`` ones) keeps the patch rows only;
    its CLS position was folded into ``cls_token`` by timm's filter."""
    grid = tuple(model.patch_embed.grid_size)
    table = hub_pos_embed(state["pos_embed"], grid, registers="register_tokens" in state)
    if getattr(model, "no_embed_class", False):
        table = table[:, 1:]
    if table.shape != model.pos_embed.shape:
        raise ValueError(
            f"the DINOv2 hub position table {tuple(table.shape)} does not fit the model's "
            f"{tuple(model.pos_embed.shape)}"
        )
    model.pos_embed.copy_(table.to(model.pos_embed.dtype))
