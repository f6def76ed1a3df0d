"""ToMe's algorithm (Bolya et al., ICLR 2023, Sec. 3): bipartite soft matching and the size-weighted merge.
Pure tensor code; :mod:`vitexp.methods.tome.patch` calls it between the attention and the MLP of every
block.

Its reasoning: docs/reading-peers.md, "vitexp/methods/tome/merge.py".
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from vitexp.methods.token_record import TokenDecision

Merge = Callable[[torch.Tensor], torch.Tensor]


def parse_r(r: int | Sequence[int], depth: int) -> list[int]:
    """``budget.r`` -> tokens merged in each of ``depth`` layers: an int is the same r in every
    layer; a list gives layer by layer and is padded with zeros (ToMe's ``parse_r``)."""
    if isinstance(r, int):
        per_layer = [r] * depth
    else:
        per_layer = [int(v) for v in r]
        if len(per_layer) > depth:
            raise ValueError(f"budget.r: {len(per_layer)} values for a backbone of {depth} layers")
        per_layer += [0] * (depth - len(per_layer))
    if any(v < 0 for v in per_layer):
        raise ValueError(f"budget.r: {r} must be >= 0 (tokens merged per layer)")
    return per_layer


class Matching(NamedTuple):
    """Steps 1–3's outcome: A tokens ``src`` (B×r, indices into A) merge into B tokens ``dst``
    (B×r, indices into B); ``unmerged`` (B×(|A| − r), ascending) are the A tokens left."""

    src: torch.Tensor
    dst: torch.Tensor
    unmerged: torch.Tensor


def match(metric: torch.Tensor, r: int, num_prefix: int) -> Matching | None:
    """Bipartite soft matching of ``metric`` (B×N×d) for r merges (steps 1–3); None when r is 0
    (r is capped at |A|)."""
    P = num_prefix
    r = min(r, (metric.shape[1] - P) // 2)
    if r <= 0:
        return None
    with torch.no_grad():
        m = metric[:, P:]
        m = m / m.norm(dim=-1, keepdim=True)
        scores = m[:, 1::2] @ m[:, 0::2].transpose(-1, -2)  # B×|A|×|B|
        best, target = scores.max(dim=-1)
        order = best.argsort(dim=-1, descending=True)
        src = order[:, :r]
        return Matching(src, target.gather(1, src), order[:, r:].sort(dim=-1).values)


def merge_fn(matching: Matching, num_prefix: int) -> Merge:
    """``merge(t)`` maps any B×N×C tensor to B×(N − r)×C (step 4), summing each merged A token
    into its B token (the weighting is the caller's)."""
    P, (src, dst, unmerged) = num_prefix, matching

    def merge(t: torch.Tensor) -> torch.Tensor:
        B, _, C = t.shape
        prefix, a, b = t[:, :P], t[:, P + 1 :: 2], t[:, P::2]
        kept = a.gather(1, unmerged.unsqueeze(-1).expand(B, unmerged.shape[1], C))
        moved = a.gather(1, src.unsqueeze(-1).expand(B, src.shape[1], C))
        b = b.scatter_reduce(1, dst.unsqueeze(-1).expand(B, dst.shape[1], C), moved, reduce="sum")
        return torch.cat([prefix, kept, b], dim=1)

    return merge


def merge_decision(matching: Matching, tokens: int) -> TokenDecision:
    """Where step 4 puts each of the ``tokens`` non-prefix tokens (counted from 0 after the prefix:
    A at the odd positions, B at the even ones):
    an unmerged A token to its rank among them, B token b to slot |unmerged| + b, a merged A
    token into its B token's slot. Merged A tokens are not kept; B tokens are."""
    src, dst, unmerged = matching
    B, n_left = unmerged.shape
    device = src.device
    a_slot = torch.empty(B, src.shape[1] + n_left, dtype=torch.long, device=device)
    a_slot.scatter_(1, unmerged, torch.arange(n_left, device=device).expand(B, n_left))
    a_slot.scatter_(1, src, n_left + dst)
    n_b = (tokens + 1) // 2
    target = torch.empty(B, tokens, dtype=torch.long, device=device)
    target[:, 0::2] = n_left + torch.arange(n_b, device=device)
    target[:, 1::2] = a_slot
    kept = torch.ones(B, tokens, dtype=torch.bool, device=device)
    kept[:, 1::2] = kept[:, 1::2].scatter(1, src, False)
    return TokenDecision(kept, target, n_left + n_b)


def merge_wavg(merge: Merge, x: torch.Tensor, size: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Size-weighted average merge: (merged x, merged sizes B×N'×1). ``size`` None means all 1."""
    if size is None:
        size = torch.ones_like(x[..., :1])
    x = merge(x * size)
    size = merge(size)
    return x / size, size
