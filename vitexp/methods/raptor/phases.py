"""RAPTOR's phases: the teacher's layer distance matrix and its contiguous max-cut partitions
(package docstring, "Phases")."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitexp.methods.raptor.surrogate import teacher_states


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
        cut = _best_cut(w, a, b, min_size)
        if cut is None or cut[1] <= f:  # the best cut's weight is at most f · ΣW/2
            return [list(range(a, b))]
        return split(a, cut[0]) + split(cut[0], b)

    return split(0, w.shape[0])


def _best_cut(
    w: torch.Tensor, a: int, b: int, min_size: int, spare: int | None = None
) -> tuple[int, float] | None:
    """The best contiguous cut of segment [a, b) and its share of the segment's edge weight.
    ``spare``: how many phases of ``min_size`` the split may lose against the segment's capacity
    (cuts that would leave too few phases for the budget are not offered)."""

    def capacity(n: int) -> int:
        return n // min_size

    cuts = [
        (s, _cut_weight(w, a, s, b))
        for s in range(a + min_size, b - min_size + 1)
        if spare is None or capacity(b - a) - capacity(s - a) - capacity(b - s) <= spare
    ]
    if not cuts:
        return None
    s, best = max(cuts, key=lambda c: c[1])
    total = float(torch.triu(w[a:b, a:b], diagonal=1).sum())  # ΣW/2: each pair of the segment once
    return s, best / total if total > 0 else 0.0


def phases_for_blocks(w: torch.Tensor, blocks: int, min_size: int = 2) -> list[list[int]]:
    """k phases (the budget = number of recurrent blocks): split, one bisection at a time, the
    segment whose best cut takes the largest share of its weight — the threshold f of
    :func:`max_cut_phases` lowered until exactly ``blocks`` phases remain. A cut that would leave
    too few layers for the remaining phases (e.g. 6 layers cut 3 | 3 when 3 phases of 2 are due)
    is skipped."""
    w = w.double()
    if blocks * min_size > w.shape[0]:
        raise ValueError(f"{w.shape[0]} layers cannot form {blocks} phases of at least {min_size} layers")
    segments = [(0, w.shape[0])]
    while len(segments) < blocks:
        spare = sum((b - a) // min_size for a, b in segments) - blocks
        options = [(i, _best_cut(w, a, b, min_size, spare)) for i, (a, b) in enumerate(segments)]
        options = [(i, c) for i, c in options if c is not None]
        i, (s, _) = max(options, key=lambda o: o[1][1])
        a, b = segments.pop(i)
        segments[i:i] = [(a, s), (s, b)]
    return [list(range(a, b)) for a, b in segments]


def layer_features(states: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """(L, B, 2, d): CLS and mean patch token of each layer's output (``states[1:]``)."""
    out = states[1:]
    return torch.stack([out[:, :, 0], out[:, :, num_prefix_tokens:].mean(dim=2)], dim=2)


def even_phases(depth: int, blocks: int) -> list[list[int]]:
    """Contiguous phases of near-equal length (used only where no data decides them)."""
    bounds = [round(i * depth / blocks) for i in range(blocks + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


@torch.no_grad()
def distance_matrix_from_data(teacher: nn.Module, loader, images: int) -> torch.Tensor:
    """RAPTOR's layer distance matrix over the first ``images`` images of ``loader``."""
    teacher = teacher.eval()
    device = next(teacher.parameters()).device
    prefix = int(getattr(teacher, "num_prefix_tokens", 1))
    from tqdm.auto import tqdm

    feats, seen = [], 0
    bar = tqdm(total=images, desc="RAPTOR phases: teacher states", unit="img", leave=False, disable=None)
    for x, _ in loader:
        x = x[: images - seen].to(device)
        bar.update(len(x))
        feats.append(layer_features(teacher_states(teacher, x), prefix).cpu())
        seen += len(x)
        if seen >= images:
            break
    bar.close()
    return layer_distance_matrix(torch.cat(feats, dim=1))
