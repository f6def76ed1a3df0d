"""SAPER's learned selection (``method.selection=lapsum``): per-head scores, the annealed LapSum gates, and
the gated model that deploys to a physically pruned one.

Its reasoning: docs/reading-saper.md, "vitexp/methods/saper/selector.py".
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from vitexp.methods.lapsum import soft_topk
from vitexp.methods.probe import ProbeModel
from vitexp.methods.saper.surgery import prune_probe_model
from vitexp.models._common import ScaledAttention


class HeadSelector(nn.Module):
    """Per-head scores and the annealed LapSum gates."""

    def __init__(
        self,
        depth: int,
        heads: int,
        k: int,
        alpha_start: float,
        alpha_end: float,
        anneal_fraction: float,
        straight_through: bool = False,
        fold_gates: bool = False,
    ):
        super().__init__()
        self.depth, self.heads, self.k = depth, heads, int(k)
        self.alpha_start, self.alpha_end, self.anneal_fraction = alpha_start, alpha_end, anneal_fraction
        self.straight_through, self.fold_gates = bool(straight_through), bool(fold_gates)
        self.scores = nn.Parameter(1e-3 * torch.randn(depth * heads))
        self.register_buffer("progress", torch.zeros(()))

    @property
    def total(self) -> int:
        return self.depth * self.heads

    def schedule(self) -> tuple[float, float]:
        """(k_t, α_t) at the current training progress (0 -> 1)."""
        t = min(1.0, float(self.progress) / max(self.anneal_fraction, 1e-8))
        # from total − ½ (soft_topk needs k < n; every gate starts near 1) down to the budget k
        k_t = self.k + (self.total - 0.5 - self.k) * 0.5 * (1 + math.cos(math.pi * t))
        alpha_t = self.alpha_start * (self.alpha_end / self.alpha_start) ** t
        return k_t, alpha_t

    def gates(self) -> torch.Tensor:
        """The gates of the next forward pass: the soft top-k at (k_t, α_t); after the anneal with
        ``straight_through``, the deployed gates in value and the soft gates' gradient."""
        k_t, alpha_t = self.schedule()
        soft = soft_topk(self.scores, k_t, alpha_t).view(self.depth, self.heads)
        if self.straight_through and float(self.progress) >= self.anneal_fraction:
            return self.deployed_gates().to(soft).detach() + soft - soft.detach()
        return soft

    def hard_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.total, device=self.scores.device)
        mask[self.scores.detach().topk(self.k).indices] = 1.0
        return mask.view(self.depth, self.heads)

    @torch.no_grad()
    def final_gates(self) -> torch.Tensor:
        """(L, H) gates at the end of the schedule (k_t = k, α_t = ``alpha_end``), whatever the progress."""
        return soft_topk(self.scores.detach(), float(self.k), self.alpha_end).view(self.depth, self.heads)

    def deployed_gates(self) -> torch.Tensor:
        """(L, H): 1 for the top-k heads, 0 elsewhere (what deployment computes); with
        ``fold_gates`` the top-k heads' final gates instead of 1."""
        mask = self.hard_mask()
        return self.final_gates() * mask if self.fold_gates else mask

    def gate_summary(self) -> dict[str, float]:
        """How far the final gates are from the hard top-k: the kept heads' smallest and mean gate,
        the removed heads' largest gate and their summed gate mass (what deployment drops)."""
        gates, mask = self.final_gates().flatten(), self.hard_mask().flatten().bool()
        dropped = gates[~mask]
        return {
            "kept_gate_min": round(float(gates[mask].min()), 6),
            "kept_gate_mean": round(float(gates[mask].mean()), 6),
            "dropped_gate_max": round(float(dropped.max()), 6) if dropped.numel() else 0.0,
            "dropped_gate_mass": round(float(dropped.sum()), 6),
        }


class HeadPrunedModel(ProbeModel):
    """The probe (or k-NN feature) model with gated heads (training) that deploys to a physically
    pruned one. The gates act through :class:`~vitexp.models._common.ScaledAttention` (timm's
    attention with ``gate_values`` before the projection), swapped onto each block's attention."""

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        selector: HeadSelector,
        hard: bool = False,
        head: nn.Module | None = None,
        pool: str = "cls_mean",
    ):
        super().__init__(backbone, num_classes, head=head, pool=pool)
        self.selector = selector
        self.hard = hard
        self.attention_classes = [type(block.attn) for block in backbone.blocks]
        for block in backbone.blocks:
            block.attn.__class__ = ScaledAttention

    def set_progress(self, fraction: float) -> None:
        self.selector.progress.fill_(fraction)

    def forward_gates(self) -> None:
        """Set every attention's gates for the next forward pass (``hard``: the deployed gates)."""
        gates = self.selector.deployed_gates() if self.hard else self.selector.gates()
        for block, g in zip(self.backbone.blocks, gates):
            block.attn.gate_values = g

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_gates()
        return super().tokens(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_gates()
        return super().forward(x)

    def kept_heads(self) -> list[list[int]]:
        """The heads deployment keeps, per layer: the top-k by score over the whole model."""
        return [m.nonzero().flatten().tolist() for m in self.selector.hard_mask()]

    def deploy(self) -> ProbeModel:
        """Keep the top-k heads by score as they are (with ``fold_gates``: their final gates folded
        into the output projection); remove the others physically (no gates left)."""
        for block in self.backbone.blocks:  # the last forward's gates (part of its autograd graph)
            block.attn.gate_values = None
        deployed = copy.deepcopy(self)
        kept, gates = deployed.kept_heads(), deployed.selector.final_gates()
        scales = (
            [[float(gates[layer, h]) for h in heads] for layer, heads in enumerate(kept)]
            if deployed.selector.fold_gates
            else None
        )
        return prune_probe_model(
            deployed.backbone, kept, deployed.head, deployed.pool, deployed.attention_classes, scales
        )
