"""RAPTOR (arXiv 2512.19941): block-recurrent surrogates of DINOv2. This module holds the parts
built so far: the phases and the surrogate's architecture, whose FLOPs follow RAPTOR's setting.
Training (stages 1 and 2), the probe and the audit come with the rest of the RAPTOR issue.

- **Phases.** The layer distance matrix is D[l, l'] = the mean over images of the sum over
  {CLS, mean of patch tokens} of 1 − cos(a_l, a_l').
  - A layer sequence is split by recursive exact max-cut bisection: brute force over every cut
    point that leaves at least ``min_size`` layers on each side.
  - It keeps splitting while the best cut's weight exceeds f · (ΣW / 2), the fraction f of the
    segment's total edge weight.
  - vitexp's reading: cuts are contiguous split points, since the phases RAPTOR reports are runs
    of consecutive layers.
  - f defaults to 0.7. A uniform segment of m layers has a best cut of m / (2(m − 1)) of its
    weight (at most 0.67 for m ≥ 4), so only real block structure passes.
- **Block.** Pre-LN attention with biases, a SwiGLU MLP (Linear d → 2·4d, SiLU(first half) ⊙
  second half, Linear 4d → d), and LayerScale initialised to 1e-5.
  - Gates come from the layer index t: Linear(1 → 16), SiLU, Linear(16 → 3d) initialised
    N(0, 1e-4), plus 1, giving (γ1, γ2, γ3).
  - The update is x ← x + γ1·LS1(Attn(LN1 x)), then x ← x + γ2·LS2(MLP(LN2 x)), and the output is
    γ3·x.
- **Surrogate.** k blocks, each applied recurrently over its phase's layers, so there are always
  as many block applications as the teacher has layers. The teacher's patch embedding, tokens,
  position embedding and final norm are reused, frozen.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import Attention, LayerScale


def layer_distance_matrix(features: torch.Tensor) -> torch.Tensor:
    """features (layers, images, 2, d) — CLS and mean patch token per layer -> (layers, layers)."""
    f = F.normalize(features.double(), dim=-1)
    cos = torch.einsum("lnsd,mnsd->lmns", f, f)  # layers x layers x images x {cls, mean}
    return (1 - cos).sum(-1).mean(-1)


def _cut_weight(w: torch.Tensor, a: int, s: int, b: int) -> float:
    return float(w[a:s, s:b].sum())


def max_cut_phases(w: torch.Tensor, f: float = 0.7, min_size: int = 2) -> list[list[int]]:
    """Recursive exact max-cut bisection of layers 0..L−1 into contiguous phases (see module docstring)."""
    w = w.double()

    def split(a: int, b: int) -> list[list[int]]:
        cuts = [(s, _cut_weight(w, a, s, b)) for s in range(a + min_size, b - min_size + 1)]
        if not cuts:
            return [list(range(a, b))]
        s, best = max(cuts, key=lambda c: c[1])
        total = float(torch.triu(w[a:b, a:b], diagonal=1).sum())  # ΣW/2 over the segment's pairs
        if best <= f * total:
            return [list(range(a, b))]
        return split(a, s) + split(s, b)

    return split(0, w.shape[0])


def _best_cut(w: torch.Tensor, a: int, b: int, min_size: int) -> tuple[int, float] | None:
    """The best contiguous cut of segment [a, b) and its share of the segment's edge weight."""
    cuts = [(s, _cut_weight(w, a, s, b)) for s in range(a + min_size, b - min_size + 1)]
    if not cuts:
        return None
    s, best = max(cuts, key=lambda c: c[1])
    total = float(torch.triu(w[a:b, a:b], diagonal=1).sum())
    return s, best / total if total > 0 else 0.0


def phases_for_blocks(w: torch.Tensor, blocks: int, min_size: int = 2) -> list[list[int]]:
    """k phases (the budget = number of recurrent blocks): split, one bisection at a time, the
    segment whose best cut takes the largest share of its weight — the threshold f of
    :func:`max_cut_phases` lowered until exactly ``blocks`` phases remain."""
    w = w.double()
    segments = [(0, w.shape[0])]
    while len(segments) < blocks:
        options = [(i, _best_cut(w, a, b, min_size)) for i, (a, b) in enumerate(segments)]
        options = [(i, c) for i, c in options if c is not None]
        if not options:
            raise ValueError(f"{w.shape[0]} layers cannot form {blocks} phases of at least {min_size} layers")
        i, (s, _) = max(options, key=lambda o: o[1][1])
        a, b = segments.pop(i)
        segments[i:i] = [(a, s), (s, b)]
    return [list(range(a, b)) for a, b in segments]


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(a) * b)


class RaptorBlock(nn.Module):
    """One recurrent block; ``forward(x, t)`` applies it as layer ``t``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, qkv_bias=True)
        self.ls1 = LayerScale(dim, init_values=1e-5)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = SwiGLU(dim, int(mlp_ratio * dim))
        self.ls2 = LayerScale(dim, init_values=1e-5)
        self.gate = nn.Sequential(nn.Linear(1, 16), nn.SiLU(), nn.Linear(16, 3 * dim))
        nn.init.normal_(self.gate[2].weight, std=1e-4)
        nn.init.zeros_(self.gate[2].bias)

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        g = 1 + self.gate(torch.full((1, 1), float(t), device=x.device, dtype=x.dtype))
        g1, g2, g3 = g.view(3, 1, 1, -1).unbind(0)
        x = x + g1 * self.ls1(self.attn(self.norm1(x)))
        x = x + g2 * self.ls2(self.mlp(self.norm2(x)))
        return g3 * x


class RaptorSurrogate(nn.Module):
    """The teacher's embedding and final norm (frozen) around k recurrent blocks over ``phases``."""

    def __init__(self, teacher: nn.Module, phases: Sequence[Sequence[int]]):
        super().__init__()
        layers = [l for p in phases for l in p]
        if sorted(layers) != list(range(len(teacher.blocks))):
            raise ValueError(f"phases {phases} must cover the teacher's layers 0..{len(teacher.blocks) - 1} once")
        import copy

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
        self.blocks = nn.ModuleList(RaptorBlock(teacher.embed_dim, heads) for _ in self.phases)

    @property
    def patch_embed(self) -> nn.Module:
        return self.teacher_embed.patch_embed

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        t = self.teacher_embed
        x = t.patch_embed(x)
        x = t._pos_embed(x)
        x = t.norm_pre(x)
        for block, phase in zip(self.blocks, self.phases):
            for layer in phase:
                x = block(x, layer)
        return t.norm(x)
