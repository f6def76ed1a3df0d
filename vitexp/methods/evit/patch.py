"""EViT's surgery on a live ViT: the blocks at ``prune_layers`` have their and their attention's class
swapped (ToMe-style), so LayerScale, drop path, the norms and LV-ViT's ``skip_lam`` stay the model's
own; the other blocks are untouched timm blocks.

Its reasoning: docs/reading-peers.md, "vitexp/methods/evit/patch.py".
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from timm.models.vision_transformer import Attention, Block

from vitexp.methods.evit.fuse import fuse_decision, keep_count, keep_rate_at, prune_and_fuse
from vitexp.methods.token_surgery import attend, heads, keep_residual_scale, project, vit_blocks


class KeepRateSchedule:
    """ρ_t = :func:`.fuse.keep_rate_at` (progress × epochs) while training; ρ in evaluation."""

    def __init__(self, target: float, start_epochs: float = 0.0, ramp_epochs: float = 0.0, epochs: int = 1):
        self.target, self.start, self.ramp, self.epochs = (
            float(target),
            float(start_epochs),
            float(ramp_epochs),
            int(epochs),
        )
        self.progress = 0.0

    def set_progress(self, fraction: float) -> None:
        self.progress = float(fraction)

    def rate(self, training: bool) -> float:
        if not training:
            return self.target
        return keep_rate_at(self.progress * self.epochs, self.target, self.start, self.ramp)


class EViTAttention(Attention):
    def forward(self, x: torch.Tensor, cls_attn: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = heads(self, x)
        if not cls_attn:
            return project(self, attend(self, q, k, v)), None
        probs = ((q[:, :, :1] * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # B×H×1×N
        out = torch.cat([self.attn_drop(probs) @ v, attend(self, q[:, :, 1:], k, v)], dim=2)
        return project(self, out), probs.mean(dim=1)[:, 0]


class EViTBlock(Block):
    """With ``record_decisions`` set, a pruning forward stores its
    :class:`~vitexp.methods.token_record.TokenDecision` in ``decision``."""

    record_decisions = False
    schedule: KeepRateSchedule
    num_prefix: int
    fuse: bool
    skip_lam: float

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        P = self.num_prefix
        candidates = int(x.shape[1]) - P
        keep = keep_count(self.schedule.rate(self.training), candidates)
        prune = keep < candidates
        out, cls_attn = self.attn(self.norm1(x), cls_attn=prune)
        x = x + self.drop_path1(self.ls1(out)) / self.skip_lam
        if prune:
            x = prune_and_fuse(x, cls_attn[:, P:], keep, P, self.fuse)
            if self.record_decisions:
                self.decision = fuse_decision(cls_attn[:, P:], keep, self.fuse)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))) / self.skip_lam


def patch_evit(
    model: nn.Module, prune_layers: Sequence[int], schedule: KeepRateSchedule, fuse: bool = True
) -> nn.Module:
    """Patch ``model`` in place: blocks ``prune_layers`` (0-based) prune and fuse after their
    attention; ``model.set_progress`` drives the keep-rate schedule."""
    blocks, num_prefix = vit_blocks(model, "EViT")
    bad = [i for i in prune_layers if not 0 <= i < len(blocks)]
    if bad:
        raise ValueError(f"method.prune_layers: {bad} outside the backbone's blocks 0..{len(blocks) - 1}")
    for i in prune_layers:
        block = blocks[i]
        keep_residual_scale(block)
        block.__class__ = EViTBlock
        block.attn.__class__ = EViTAttention
        block.schedule, block.num_prefix, block.fuse = schedule, num_prefix, bool(fuse)
    model.set_progress = schedule.set_progress
    return model
