"""What ToMe and EViT share when they patch a live ViT (ToMe-style class swap).

Its reasoning: docs/reading-peers.md, "vitexp/methods/token_surgery.py".
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import Attention, Block


def vit_blocks(model: nn.Module, method: str) -> tuple[nn.ModuleList, int]:
    """(blocks, number of prefix tokens) of a ViT whose blocks are timm ``Block``s with timm
    ``Attention``; a ``TypeError`` naming what is supported otherwise."""
    blocks = getattr(model, "blocks", None)
    ok = (
        blocks is not None
        and len(blocks)
        and all(
            isinstance(b, Block) and isinstance(b.attn, Attention) and getattr(b.attn, "gate", None) is None
            for b in blocks
        )
    )
    if not ok:
        raise TypeError(
            f"{method} patches ViTs built from timm Blocks and Attention (DeiT, DINOv2, T2T-ViT, "
            f"LV-ViT); {type(model).__name__} is not one"
        )
    return blocks, int(getattr(model, "num_prefix_tokens", 1))


def keep_residual_scale(block: nn.Module) -> None:
    """Pin the residual divisor (LV-ViT's ``skip_lam``, 1 for timm's Block) on the instance."""
    block.skip_lam = float(getattr(block, "skip_lam", 1.0))


def heads(attn: Attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, _ = x.shape
    q, k, v = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return attn.q_norm(q), attn.k_norm(k), v


def attend(
    attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q kᵀ · scale + bias) v with SDPA (the fused kernel; a float ``bias`` keeps the
    memory-efficient kernels on a GPU)."""
    drop = attn.attn_drop.p if attn.training else 0.0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop, scale=attn.scale)


def project(attn: Attention, out: torch.Tensor) -> torch.Tensor:
    """B×H×N×d attention output -> B×N×C through timm's norm, projection and dropout."""
    B, H, N, d = out.shape
    return attn.proj_drop(attn.proj(attn.norm(out.transpose(1, 2).reshape(B, N, H * d))))
