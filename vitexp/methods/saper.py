"""SAPER: attention-head pruning with the LapSum soft top-k (arXiv 2608.00264), as vitexp reads it.

This module holds the parts that exist so far: head selection, gating, physical removal, and the
probe model whose FLOPs follow SAPER's protocol. The training objectives (fine-tune and
distillation) come with the rest of the SAPER issue.

- **Selection.** One learnable score per head over all heads of the model (L×H: 72 for ViT-S/14,
  144 for ViT-B/14). The gates are g = soft_topk(scores, k_t, α_t) (vitexp/methods/lapsum.py),
  and each head's output is scaled by its gate before the output projection.
- **Schedule** (config keys). k_t anneals from the total head count (less ½, as the soft top-k needs
  k < n) to the budget k by a cosine
  over the first ``anneal_fraction`` of training; α_t falls geometrically from ``alpha_start`` to
  ``alpha_end`` over the same span.
- **Deployment** keeps the top-k heads by score and **physically removes** the rest: their
  q, k, v output rows and output-projection input columns are deleted. A layer with no head left
  keeps only the output projection's bias, a constant with no MACs, so the deployed model equals
  the hard-gated one.
- **Probe model** (SAPER's head). A linear classifier on [CLS ‖ mean of patch tokens] after the
  backbone's final norm; register tokens are excluded from the mean. Its MACs are counted with
  the model's.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping

import torch
import torch.nn as nn
from timm.models.vision_transformer import Attention

from vitexp.methods.base import Method
from vitexp.models._common import ScaledAttention
from vitexp.methods.lapsum import soft_topk


class ProbeModel(nn.Module):
    """Backbone features -> Linear(2d -> classes) on [CLS ‖ mean of patch tokens]."""

    def __init__(self, backbone: nn.Module, num_classes: int, head: nn.Linear | None = None):
        super().__init__()
        backbone.reset_classifier(0)
        self.backbone = backbone
        self.num_prefix_tokens = int(getattr(backbone, "num_prefix_tokens", 1))
        self.head = head if head is not None else nn.Linear(2 * backbone.embed_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.backbone.forward_features(x)
        return torch.cat([tokens[:, 0], tokens[:, self.num_prefix_tokens:].mean(dim=1)], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


#: The gated attention SAPER swaps in: timm's attention with per-head gates before the projection.
GatedAttention = ScaledAttention


class ConstantBranch(nn.Module):
    """A layer whose heads were all removed: the output projection's bias, broadcast (no MACs)."""

    def __init__(self, bias: torch.Tensor | None, dim: int):
        super().__init__()
        self.register_buffer("bias", bias.detach().clone() if bias is not None else torch.zeros(dim))

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        return self.bias.expand_as(x)


def prune_attention_heads(attn: Attention, keep: torch.Tensor) -> nn.Module:
    """A timm ``Attention`` with only the heads in ``keep`` (indices), or a :class:`ConstantBranch`."""
    dim = attn.qkv.in_features
    if keep.numel() == 0:
        return ConstantBranch(attn.proj.bias, attn.proj.out_features)
    H, d = attn.num_heads, attn.head_dim
    rows = torch.cat([(part * H + keep).mul(d).unsqueeze(-1) + torch.arange(d) for part in range(3)]).flatten()
    cols = (keep.mul(d).unsqueeze(-1) + torch.arange(d)).flatten()
    qkv = nn.Linear(dim, rows.numel(), bias=attn.qkv.bias is not None).to(attn.qkv.weight)
    qkv.weight.data.copy_(attn.qkv.weight.data[rows])
    if attn.qkv.bias is not None:
        qkv.bias.data.copy_(attn.qkv.bias.data[rows])
    proj = nn.Linear(cols.numel(), attn.proj.out_features, bias=attn.proj.bias is not None).to(attn.proj.weight)
    proj.weight.data.copy_(attn.proj.weight.data[:, cols])
    if attn.proj.bias is not None:
        proj.bias.data.copy_(attn.proj.bias.data)
    attn.qkv, attn.proj = qkv, proj
    attn.num_heads = int(keep.numel())
    attn.attn_dim = attn.num_heads * d
    if not isinstance(attn.norm, nn.Identity):
        raise TypeError("head pruning with a scale norm over all heads is not supported")
    attn.__class__ = GatedAttention
    attn.gate_values = None
    return attn


class HeadSelector(nn.Module):
    """Per-head scores and the annealed LapSum gates."""

    def __init__(self, depth: int, heads: int, k: int, alpha_start: float, alpha_end: float, anneal_fraction: float):
        super().__init__()
        self.depth, self.heads, self.k = depth, heads, int(k)
        self.alpha_start, self.alpha_end, self.anneal_fraction = alpha_start, alpha_end, anneal_fraction
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
        k_t, alpha_t = self.schedule()
        return soft_topk(self.scores, k_t, alpha_t).view(self.depth, self.heads)

    def hard_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.total, device=self.scores.device)
        mask[self.scores.detach().topk(self.k).indices] = 1.0
        return mask.view(self.depth, self.heads)


class HeadPrunedModel(ProbeModel):
    """The probe model with gated heads (training) that deploys to a physically pruned one."""

    def __init__(self, backbone: nn.Module, num_classes: int, selector: HeadSelector, hard: bool = False):
        super().__init__(backbone, num_classes)
        self.selector = selector
        self.hard = hard
        for block in backbone.blocks:
            block.attn.__class__ = GatedAttention

    def set_progress(self, fraction: float) -> None:
        self.selector.progress.fill_(fraction)

    def forward_gates(self) -> None:
        """Set every attention's gates for the next forward pass (hard top-k when ``hard``)."""
        gates = self.selector.hard_mask() if self.hard else self.selector.gates()
        for block, g in zip(self.backbone.blocks, gates):
            block.attn.gate_values = g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_gates()
        return super().forward(x)

    def deploy(self) -> ProbeModel:
        """Keep the top-k heads by score; remove the others physically."""
        import copy

        deployed = copy.deepcopy(self)
        mask = deployed.selector.hard_mask()
        for block, m in zip(deployed.backbone.blocks, mask):
            block.attn = prune_attention_heads(block.attn, m.nonzero().flatten().cpu())
        return ProbeModel(deployed.backbone, deployed.head.out_features, head=deployed.head)


def head_count(model: nn.Module) -> int:
    """Attention heads present in a model (a ConstantBranch has none)."""
    from vitexp.flops import count_heads

    return count_heads(model)


def require_vit(method: str, arch: Mapping[str, Any]) -> None:
    """SAPER's methods read a ViT's CLS and patch tokens from ``forward_features``."""
    from vitexp.errors import ConfigError

    if arch.get("family") == "metaformer":
        raise ConfigError(f"method {method} does not apply to a MetaFormer backbone: it needs a ViT's blocks and "
                          "CLS token (use a DINOv2, DeiT, T2T-ViT or LV-ViT backbone)")


class SaperHeads(Method):
    """Head selection under a head budget (``budget=heads``, ``budget.k``)."""

    objective: ClassVar[str] = "classify"
    budget_kinds: ClassVar[tuple[str, ...]] = ("heads",)

    def __init__(self, name: str = "saper_ft", alpha_start: float = 1.0, alpha_end: float = 0.01,
                 anneal_fraction: float = 0.7, freeze_backbone: bool = True):
        super().__init__(name)
        self.alpha_start, self.alpha_end = float(alpha_start), float(alpha_end)
        self.anneal_fraction, self.freeze_backbone = float(anneal_fraction), bool(freeze_backbone)

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        from vitexp.errors import ConfigError

        super().validate_budget(budget, arch)
        require_vit(self.name, arch)
        total = int(arch["depth"]) * int(arch["num_heads"])
        if not 1 <= int(budget["k"]) < total:
            raise ConfigError(f"budget.k: {budget['k']} heads must be in [1, {total - 1}] "
                              f"(the backbone has {total} heads)")

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        num_classes = backbone.num_classes
        depth, heads = len(backbone.blocks), backbone.blocks[0].attn.num_heads
        if self.freeze_backbone:
            for p in backbone.parameters():
                p.requires_grad_(False)
        selector = HeadSelector(depth, heads, int(budget["k"]), self.alpha_start, self.alpha_end, self.anneal_fraction)
        return HeadPrunedModel(backbone, num_classes, selector)

    def deploy(self, model: nn.Module) -> nn.Module:
        return model.deploy() if isinstance(model, HeadPrunedModel) else model


class DistillPair(nn.Module):
    """A head-pruned student and its frozen unpruned teacher. ``forward`` gives the student's
    k-NN features ([CLS ‖ mean patch] after the final norm); ``distill_targets`` the student's and
    teacher's tokens (CLS and patches; registers excluded)."""

    def __init__(self, student: HeadPrunedModel, teacher: nn.Module):
        super().__init__()
        self.student = student
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def set_progress(self, fraction: float) -> None:
        self.student.set_progress(fraction)

    def train(self, mode: bool = True) -> "DistillPair":
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.student.forward_gates()
        return self.student.features(x)

    def distill_targets(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.student.forward_gates()
        p = self.student.num_prefix_tokens
        s = self.student.backbone.forward_features(x)
        with torch.no_grad():
            t = self.teacher.forward_features(x)
        keep = [0] + list(range(p, s.shape[1]))
        return s[:, keep], t[:, keep]

    def deploy(self) -> ProbeModel:
        return self.student.deploy()


class SaperDistill(SaperHeads):
    """``method=saper_kd``: the student's tokens regress onto the frozen teacher's; k-NN evaluation."""

    objective: ClassVar[str] = "distill"

    def __init__(self, name: str = "saper_kd", alpha_start: float = 1.0, alpha_end: float = 0.01,
                 anneal_fraction: float = 0.7, freeze_backbone: bool = True, loss: str = "mse",
                 knn_k: int = 20, knn_temperature: float = 0.07):
        super().__init__(name, alpha_start, alpha_end, anneal_fraction, freeze_backbone)
        self.loss, self.knn_k, self.knn_temperature = loss, int(knn_k), float(knn_temperature)

    def module_kwargs(self) -> dict[str, Any]:
        return {"loss": self.loss, "knn_k": self.knn_k, "knn_temperature": self.knn_temperature}

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        import copy

        teacher = copy.deepcopy(backbone)
        teacher.reset_classifier(0)
        return DistillPair(super().apply(backbone, budget), teacher)

    def deploy(self, model: nn.Module) -> nn.Module:
        return model.deploy() if isinstance(model, DistillPair) else super().deploy(model)


class LinearProbe(Method):
    """``method=probe``: the unpruned, frozen backbone with SAPER's linear head (its reference rows)."""

    objective: ClassVar[str] = "classify"
    budget_kinds: ClassVar[tuple[str, ...]] = ("none",)

    def __init__(self, name: str = "probe"):
        super().__init__(name)

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        super().validate_budget(budget, arch)
        require_vit(self.name, arch)

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        num_classes = backbone.num_classes
        for p in backbone.parameters():
            p.requires_grad_(False)
        return ProbeModel(backbone, num_classes)
