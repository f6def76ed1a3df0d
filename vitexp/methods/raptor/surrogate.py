"""RAPTOR's recurrent block and the k-block surrogate around the teacher's embedding and final
norm (package docstring, "Block" and "Surrogate"), and the teacher's states h_0..h_L."""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn as nn
from timm.layers import GluMlp, Mlp
from timm.models.vision_transformer import Attention, LayerScale


def swiglu(dim: int, hidden: int) -> nn.Module:
    """RAPTOR's MLP: Linear d → 2·hidden, SiLU(first half) ⊙ second half, Linear hidden → d
    (timm's ``GluMlp`` with the gate first)."""
    return GluMlp(dim, 2 * hidden, act_layer=nn.SiLU, gate_last=False)


#: ``swiglu`` is RAPTOR's block; ``gelu`` (the teacher's Linear d -> 4d, GELU, Linear 4d -> d) is
#: the audit's counterfactual that isolates the SwiGLU MLP's share of RAPTOR's FLOPs.
MLP_KINDS = ("swiglu", "gelu")


class RaptorBlock(nn.Module):
    """One recurrent block; ``forward(x, layer)`` applies it as the teacher's 0-based layer ``layer``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, mlp: str = "swiglu"):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)  # RAPTOR's nn.LayerNorm default, not DINOv2's 1e-6
        self.attn = Attention(dim, num_heads, qkv_bias=True)
        self.ls1 = LayerScale(dim, init_values=1e-5)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        if mlp not in MLP_KINDS:
            raise ValueError(f"method.mlp={mlp!r}: valid MLPs are {MLP_KINDS}")
        self.mlp = swiglu(dim, int(mlp_ratio * dim)) if mlp == "swiglu" else Mlp(dim, int(mlp_ratio * dim))
        self.ls2 = LayerScale(dim, init_values=1e-5)
        self.gate = nn.Sequential(nn.Linear(1, 16), nn.SiLU(), nn.Linear(16, 3 * dim))
        nn.init.normal_(self.gate[2].weight, std=1e-4)
        nn.init.normal_(self.gate[2].bias, std=1e-4)

    def forward(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Apply the block as the teacher's (0-based) layer ``layer``; the gate MLP sees
        t = layer + 1, the 1-based index of the layer whose output this application produces."""
        t = float(layer + 1)
        g = 1 + self.gate(torch.full((1, 1), t, device=x.device, dtype=x.dtype))
        g1, g2, g3 = g.view(3, 1, 1, -1).unbind(0)
        x = x + g1 * self.ls1(self.attn(self.norm1(x)))
        x = x + g2 * self.ls2(self.mlp(self.norm2(x)))
        return g3 * x


class RaptorSurrogate(nn.Module):
    """The teacher's embedding and final norm (frozen) around k recurrent blocks over ``phases``."""

    def __init__(self, teacher: nn.Module, phases: Sequence[Sequence[int]], mlp: str = "swiglu"):
        super().__init__()
        layers = [l for p in phases for l in p]
        if sorted(layers) != list(range(len(teacher.blocks))):
            raise ValueError(
                f"phases {phases} must cover the teacher's layers 0..{len(teacher.blocks) - 1} once"
            )
        self.phases = [list(p) for p in phases]
        self.embed_dim = teacher.embed_dim
        self.num_prefix_tokens = teacher.num_prefix_tokens
        self.num_classes = 0
        heads = teacher.blocks[0].attn.num_heads
        # the teacher without its blocks: patch embedding, CLS/register tokens, positions, final norm
        self.teacher_embed = copy.deepcopy(teacher)
        self.teacher_embed.blocks = nn.ModuleList()
        self.teacher_embed.reset_classifier(0)
        for p in self.teacher_embed.parameters():
            p.requires_grad_(False)
        self.blocks = nn.ModuleList(RaptorBlock(teacher.embed_dim, heads, mlp=mlp) for _ in self.phases)

    @property
    def patch_embed(self) -> nn.Module:
        return self.teacher_embed.patch_embed

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = embed_tokens(self.teacher_embed, x)
        for block, phase in zip(self.blocks, self.phases):
            for layer in phase:
                x = block(x, layer)
        return self.teacher_embed.norm(x)


# -- the teacher's states and the losses ---------------------------------------------------------
def embed_tokens(vit: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """h_0: a timm ViT's tokens before its first block (patch embedding, prefix tokens, positions)."""
    x = vit.patch_embed(x)
    x = vit._pos_embed(x)
    x = vit.patch_drop(x) if hasattr(vit, "patch_drop") else x
    return vit.norm_pre(x)


@torch.no_grad()
def teacher_states(teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(L + 1, B, T, d): h_0 and every block's output (the residual stream, before the final norm)."""
    h = [embed_tokens(teacher, x)]
    for block in teacher.blocks:
        h.append(block(h[-1]))
    return torch.stack(h)
