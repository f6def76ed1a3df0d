"""Physical head removal on a live timm ViT: the deployed model of every SAPER selection rule.

A removed head loses its q, k, v output rows and its output-projection input columns; the
attention stays its own (ungated) class with fewer heads. A layer with no head left keeps only the
output projection's bias (:class:`ConstantBranch`, a constant with no MACs), so the deployed model
equals the hard-gated one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.models.vision_transformer import Attention

from vitexp.methods.probe import ProbeModel


class ConstantBranch(nn.Module):
    """A layer whose heads were all removed: the output projection's bias, broadcast (no MACs)."""

    def __init__(self, bias: torch.Tensor | None, dim: int):
        super().__init__()
        self.register_buffer("bias", bias.detach().clone() if bias is not None else torch.zeros(dim))

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        return self.bias.expand_as(x)


def prune_attention_heads(
    attn: Attention,
    keep: torch.Tensor | list[int],
    attention_class: type[nn.Module] | None = None,
    scales: list[float] | None = None,
) -> nn.Module:
    """A timm ``Attention`` with only the heads in ``keep`` (indices), or a :class:`ConstantBranch`.
    The result is an instance of ``attention_class`` (default: its own class) with no gates.
    ``scales`` (one per kept head) multiply each kept head's output-projection columns: a gate folded in."""
    keep = torch.as_tensor(keep, dtype=torch.long).flatten().cpu()
    dim = attn.qkv.in_features
    if keep.numel() == 0:
        return ConstantBranch(attn.proj.bias, attn.proj.out_features)
    if not isinstance(attn.norm, nn.Identity):
        raise TypeError("head pruning with a scale norm over all heads is not supported")
    H, d = attn.num_heads, attn.head_dim
    rows = torch.cat(
        [(part * H + keep).mul(d).unsqueeze(-1) + torch.arange(d) for part in range(3)]
    ).flatten()
    cols = (keep.mul(d).unsqueeze(-1) + torch.arange(d)).flatten()
    qkv = nn.Linear(dim, rows.numel(), bias=attn.qkv.bias is not None).to(attn.qkv.weight)
    qkv.weight.data.copy_(attn.qkv.weight.data[rows])
    if attn.qkv.bias is not None:
        qkv.bias.data.copy_(attn.qkv.bias.data[rows])
    proj = nn.Linear(cols.numel(), attn.proj.out_features, bias=attn.proj.bias is not None).to(
        attn.proj.weight
    )
    proj.weight.data.copy_(attn.proj.weight.data[:, cols])
    if scales is not None:
        proj.weight.data.mul_(
            torch.as_tensor(scales, dtype=proj.weight.dtype, device=proj.weight.device).repeat_interleave(d)
        )
    if attn.proj.bias is not None:
        proj.bias.data.copy_(attn.proj.bias.data)
    attn.qkv, attn.proj = qkv, proj
    attn.num_heads = int(keep.numel())
    attn.attn_dim = attn.num_heads * d
    attn.__dict__.pop("gate_values", None)
    attn.__class__ = attention_class or type(attn)
    return attn


def prune_probe_model(
    backbone: nn.Module,
    kept_heads: list[list[int]],
    head: nn.Module,
    pool: str,
    attention_classes: list[type[nn.Module]] | None = None,
    head_scales: list[list[float]] | None = None,
) -> ProbeModel:
    """``backbone`` with only ``kept_heads[l]`` in layer l, under ``head`` on ``pool`` features;
    ``head_scales[l]`` (one per kept head) folded into layer l's output projection."""
    if len(kept_heads) != len(backbone.blocks):
        raise ValueError(
            f"kept_heads lists {len(kept_heads)} layers but the backbone has {len(backbone.blocks)}"
        )
    classes = attention_classes or [None] * len(kept_heads)
    scales = head_scales or [None] * len(kept_heads)
    for block, heads, cls, scale in zip(backbone.blocks, kept_heads, classes, scales):
        block.attn = prune_attention_heads(block.attn, heads, cls, scale)
    return ProbeModel(backbone, 0, head=head, pool=pool)
