"""EViT's algorithm (Liang et al., ICLR 2022, "Not All Patches are What You Need"), as its public code
(``evit.py``, ``helpers.py``) computes it. Pure tensor code; :mod:`.patch` calls it between the
attention and the MLP of the pruning blocks.

Its reasoning: docs/reading-peers.md, "vitexp/methods/evit/fuse.py".
"""

from __future__ import annotations

import math

import torch

from vitexp.methods.token_record import TokenDecision


def keep_count(keep_rate: float, candidates: int) -> int:
    """⌈ρ·M⌉ (at least 1); the product is rounded to 1e-9 first so that 0.7·100 keeps 70."""
    return max(1, math.ceil(round(keep_rate * candidates, 9)))


def keep_rate_at(epoch: float, target: float, start: float, ramp: float) -> float:
    if epoch < start:
        return 1.0
    if ramp <= 0 or epoch >= start + ramp:
        return target
    return target + (1.0 - target) * 0.5 * (1.0 + math.cos(math.pi * (epoch - start) / ramp))


def rank(cls_attn: torch.Tensor) -> torch.Tensor:
    """B×M candidates' indices, most CLS-attended first (the kept ones are the first k)."""
    return cls_attn.argsort(dim=1, descending=True)


def fuse_decision(cls_attn: torch.Tensor, keep: int, fuse: bool = True) -> TokenDecision:
    """Where :func:`prune_and_fuse` puts each candidate: the i-th most attended to output slot i
    (i < k); the others into the fused token (slot k), or dropped (−1) without fusion."""
    B, M = cls_attn.shape
    order = rank(cls_attn)
    rest = keep if fuse and keep < M else -1
    slots = torch.full((B, M), rest, dtype=torch.long, device=cls_attn.device)
    slots[:, :keep] = torch.arange(keep, device=cls_attn.device)
    target = torch.empty_like(slots).scatter_(1, order, slots)
    kept = torch.zeros(B, M, dtype=torch.bool, device=cls_attn.device).scatter_(1, order[:, :keep], True)
    return TokenDecision(kept, target, keep + int(rest >= 0))


def prune_and_fuse(
    x: torch.Tensor, cls_attn: torch.Tensor, keep: int, num_prefix: int, fuse: bool = True
) -> torch.Tensor:
    """x: B×N×C, cls_attn: B×(N−P) (head-averaged CLS attention to the candidates) ->
    B×(P + keep + fuse)×C: prefix, kept candidates (most attended first), fused token."""
    B, _, C = x.shape
    P = num_prefix
    candidates = x[:, P:]
    order = rank(cls_attn)
    kept = candidates.gather(1, order[:, :keep].unsqueeze(-1).expand(B, keep, C))
    parts = [x[:, :P], kept]
    if fuse and keep < candidates.shape[1]:
        rest = order[:, keep:]
        weights = cls_attn.gather(1, rest).unsqueeze(1)  # B×1×(M−k)
        parts.append(
            weights.to(x.dtype) @ candidates.gather(1, rest.unsqueeze(-1).expand(B, rest.shape[1], C))
        )
    return torch.cat(parts, dim=1)
