"""ToMe's surgery on a live ViT: each block's and attention's class is swapped (as ToMe's ``apply_patch``
does for timm), so LayerScale, drop path, the norms and LV-ViT's ``skip_lam`` stay the model's own.

Its reasoning: docs/reading-peers.md, "vitexp/methods/tome/patch.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from timm.models.vision_transformer import Attention, Block

from vitexp.methods.token_surgery import attend, heads, keep_residual_scale, project, vit_blocks
from vitexp.methods.tome.merge import match, merge_decision, merge_fn, merge_wavg


@dataclass
class MergeState:
    r: list[int]
    num_prefix: int
    prop_attn: bool = True
    size: torch.Tensor | None = None  # B×N×1 sizes of the current tokens (None: all 1)


class ToMeAttention(Attention):
    def forward(self, x: torch.Tensor, size: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = heads(self, x)
        bias = size.log()[:, None, None, :, 0] if size is not None else None
        return project(self, attend(self, q, k, v, bias)), k.mean(dim=1)


class ToMeBlock(Block):
    """With ``record_decisions`` set, a merging forward stores its
    :class:`~vitexp.methods.token_record.TokenDecision` in ``decision``."""

    record_decisions = False
    tome: MergeState
    layer: int
    skip_lam: float

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        state = self.tome
        if self.layer == 0:
            state.size = None
        out, metric = self.attn(self.norm1(x), state.size if state.prop_attn else None)
        x = x + self.drop_path1(self.ls1(out)) / self.skip_lam
        matching = match(metric, state.r[self.layer], state.num_prefix)
        if matching is not None:
            x, state.size = merge_wavg(merge_fn(matching, state.num_prefix), x, state.size)
            if self.record_decisions:
                self.decision = merge_decision(matching, metric.shape[1] - state.num_prefix)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))) / self.skip_lam


def patch_tome(model: nn.Module, r: list[int], prop_attn: bool = True) -> MergeState:
    """Patch ``model`` in place to merge ``r[i]`` tokens in layer i; returns the shared state."""
    blocks, num_prefix = vit_blocks(model, "ToMe")
    if len(r) != len(blocks):
        raise ValueError(f"ToMe: {len(r)} per-layer r values for {len(blocks)} blocks")
    state = MergeState(r=list(r), num_prefix=num_prefix, prop_attn=prop_attn)
    for i, block in enumerate(blocks):
        keep_residual_scale(block)
        block.__class__ = ToMeBlock
        block.attn.__class__ = ToMeAttention
        block.tome, block.layer = state, i
    return state
