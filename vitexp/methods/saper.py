"""SAPER: attention-head pruning with the LapSum soft top-k (arXiv 2608.00264), as vitexp reads it.

- **Selection.** One learnable score per head over all heads of the model (L×H: 72 for ViT-S/14,
  144 for ViT-B/14). The gates are g = soft_topk(scores, k_t, α_t) (vitexp/methods/lapsum.py),
  and each head's output is scaled by its gate before the output projection.
- **Schedule** (config keys). k_t anneals from the total head count (less ½, as the soft top-k needs
  k < n) to the budget k by a cosine
  over the first ``anneal_fraction`` of training; α_t falls geometrically from ``alpha_start`` to
  ``alpha_end`` over the same span.
- **What trains** (``trainable``): ``scores`` (the head scores, plus the linear probe in fine-tune
  mode; every backbone weight frozen), ``mlp`` (also the blocks' MLPs; attention weights frozen) or
  ``all``.
- **Deployment** keeps the top-k heads by score and **physically removes** the rest: their
  q, k, v output rows and output-projection input columns are deleted, and the attention goes back
  to its own (ungated) class. A layer with no head left keeps only the output projection's bias, a
  constant with no MACs, so the deployed model equals the hard-gated one. The kept heads per layer
  (:meth:`HeadPrunedModel.kept_heads`) go into the ledger (``kept_heads``), from which
  :meth:`SaperHeads.rebuild_deployed` rebuilds the deployed architecture for the saved weights.
  Accuracy is reported for the deployed model (vitexp/train.py tests ``Method.deploy(model)``).
- **Probe model** (SAPER's head). A linear classifier on [CLS ‖ mean of patch tokens] after the
  backbone's final norm; register tokens are excluded from the mean. Its MACs are counted with
  the model's.
- **k-NN features** (distillation mode and ``method=knn``): ``knn_features: cls`` (DINO's k-NN
  evaluation uses the CLS token only) or ``cls_mean`` ([CLS ‖ mean patch]); the deployed model's
  output is that feature vector (no linear head).
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping

import torch
import torch.nn as nn
from timm.models.vision_transformer import Attention

from vitexp.methods.base import Method, Stage
from vitexp.models._common import ScaledAttention
from vitexp.methods.lapsum import soft_topk


#: Token pooling of a probe or k-NN feature: [CLS ‖ mean of patch tokens], or CLS alone.
POOLS = ("cls_mean", "cls")
#: What trains in a SAPER run besides the head scores (method.trainable).
TRAINABLE = ("scores", "mlp", "all")


class ProbeModel(nn.Module):
    """Backbone features -> ``head``. ``pool="cls_mean"``: [CLS ‖ mean of patch tokens] (SAPER's
    linear head, Linear(2d -> classes)); ``pool="cls"``: the CLS token. With ``head=nn.Identity()``
    the output is the feature vector itself (a k-NN classifier's input)."""

    def __init__(self, backbone: nn.Module, num_classes: int, head: nn.Module | None = None, pool: str = "cls_mean"):
        super().__init__()
        if pool not in POOLS:
            raise ValueError(f"pool={pool!r}: valid choices are {POOLS}")
        backbone.reset_classifier(0)
        self.backbone = backbone
        self.pool = pool
        self.num_prefix_tokens = int(getattr(backbone, "num_prefix_tokens", 1))
        width = backbone.embed_dim * (2 if pool == "cls_mean" else 1)
        self.head = head if head is not None else nn.Linear(width, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.backbone.forward_features(x)
        if self.pool == "cls":
            return tokens[:, 0]
        return torch.cat([tokens[:, 0], tokens[:, self.num_prefix_tokens:].mean(dim=1)], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def feature_model(backbone: nn.Module, pool: str) -> ProbeModel:
    """The backbone's k-NN features (no linear head)."""
    return ProbeModel(backbone, 0, head=nn.Identity(), pool=pool)


#: The gated attention SAPER swaps in: timm's attention with per-head gates before the projection.
GatedAttention = ScaledAttention


class ConstantBranch(nn.Module):
    """A layer whose heads were all removed: the output projection's bias, broadcast (no MACs)."""

    def __init__(self, bias: torch.Tensor | None, dim: int):
        super().__init__()
        self.register_buffer("bias", bias.detach().clone() if bias is not None else torch.zeros(dim))

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        return self.bias.expand_as(x)


def prune_attention_heads(attn: Attention, keep: torch.Tensor | list[int],
                          attention_class: type[nn.Module] | None = None) -> nn.Module:
    """A timm ``Attention`` with only the heads in ``keep`` (indices), or a :class:`ConstantBranch`.
    The result is an instance of ``attention_class`` (default: its own class) with no gates."""
    keep = torch.as_tensor(keep, dtype=torch.long).flatten().cpu()
    dim = attn.qkv.in_features
    if keep.numel() == 0:
        return ConstantBranch(attn.proj.bias, attn.proj.out_features)
    if not isinstance(attn.norm, nn.Identity):
        raise TypeError("head pruning with a scale norm over all heads is not supported")
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
    attn.__dict__.pop("gate_values", None)
    attn.__class__ = attention_class or type(attn)
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
    """The probe (or k-NN feature) model with gated heads (training) that deploys to a physically
    pruned one."""

    def __init__(self, backbone: nn.Module, num_classes: int, selector: HeadSelector, hard: bool = False,
                 head: nn.Module | None = None, pool: str = "cls_mean"):
        super().__init__(backbone, num_classes, head=head, pool=pool)
        self.selector = selector
        self.hard = hard
        self.attention_classes = [type(block.attn) for block in backbone.blocks]
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

    def kept_heads(self) -> list[list[int]]:
        """The heads deployment keeps, per layer: the top-k by score over the whole model."""
        return [m.nonzero().flatten().tolist() for m in self.selector.hard_mask()]

    def deploy(self) -> ProbeModel:
        """Keep the top-k heads by score; remove the others physically (no gates left)."""
        import copy

        for block in self.backbone.blocks:  # the last forward's gates (part of its autograd graph)
            block.attn.gate_values = None
        deployed = copy.deepcopy(self)
        return prune_probe_model(deployed.backbone, deployed.kept_heads(), deployed.head, deployed.pool,
                                 deployed.attention_classes)


def prune_probe_model(backbone: nn.Module, kept_heads: list[list[int]], head: nn.Module, pool: str,
                      attention_classes: list[type[nn.Module]] | None = None) -> ProbeModel:
    """``backbone`` with only ``kept_heads[l]`` in layer l, under ``head`` on ``pool`` features."""
    if len(kept_heads) != len(backbone.blocks):
        raise ValueError(f"kept_heads lists {len(kept_heads)} layers but the backbone has {len(backbone.blocks)}")
    classes = attention_classes or [None] * len(kept_heads)
    for block, heads, cls in zip(backbone.blocks, kept_heads, classes):
        block.attn = prune_attention_heads(block.attn, heads, cls)
    return ProbeModel(backbone, 0, head=head, pool=pool)


def head_count(model: nn.Module) -> int:
    """Attention heads present in a model (a ConstantBranch has none)."""
    from vitexp.flops import count_heads

    return count_heads(model)


def require_vit(method: str, arch: Mapping[str, Any]) -> None:
    """SAPER's methods read a ViT's CLS and patch tokens from ``forward_features``."""
    from vitexp.errors import ConfigError

    family = {"metaformer": "MetaFormer", "shvit": "SHViT"}.get(arch.get("family", "vit"))
    if family:
        raise ConfigError(f"method {method} does not apply to a {family} backbone: it needs a ViT's blocks and "
                          "CLS token (use a DINOv2, DeiT, T2T-ViT or LV-ViT backbone)")


def set_trainable(backbone: nn.Module, trainable: str) -> None:
    """``scores``: every backbone weight frozen; ``mlp``: only the blocks' MLPs train (attention,
    norms, LayerScale, embeddings frozen); ``all``: every backbone weight trains."""
    for p in backbone.parameters():
        p.requires_grad_(trainable == "all")
    if trainable == "mlp":
        for block in backbone.blocks:
            for p in block.mlp.parameters():
                p.requires_grad_(True)


def _choice(key: str, value: str, valid: tuple[str, ...]) -> str:
    from vitexp.errors import ConfigError

    if value not in valid:
        raise ConfigError(f"{key}={value!r}: valid choices are {list(valid)}")
    return value


class SaperHeads(Method):
    """Head selection under a head budget (``budget=heads``, ``budget.k``)."""

    objective: ClassVar[str] = "classify"
    budget_kinds: ClassVar[tuple[str, ...]] = ("heads",)

    def __init__(self, name: str = "saper_ft", alpha_start: float = 1.0, alpha_end: float = 0.01,
                 anneal_fraction: float = 0.7, trainable: str = "scores"):
        super().__init__(name)
        self.alpha_start, self.alpha_end = float(alpha_start), float(alpha_end)
        self.anneal_fraction = float(anneal_fraction)
        self.trainable = _choice("method.trainable", trainable, TRAINABLE)
        self.kept_heads: list[list[int]] | None = None

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        from vitexp.errors import ConfigError

        super().validate_budget(budget, arch)
        require_vit(self.name, arch)
        total = int(arch["depth"]) * int(arch["num_heads"])
        if not 1 <= int(budget["k"]) < total:
            raise ConfigError(f"budget.k: {budget['k']} heads must be in [1, {total - 1}] "
                              f"(the backbone has {total} heads)")

    def _selector(self, backbone: nn.Module, budget: Mapping[str, Any]) -> HeadSelector:
        set_trainable(backbone, self.trainable)
        depth, heads = len(backbone.blocks), backbone.blocks[0].attn.num_heads
        return HeadSelector(depth, heads, int(budget["k"]), self.alpha_start, self.alpha_end, self.anneal_fraction)

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        num_classes = backbone.num_classes
        return HeadPrunedModel(backbone, num_classes, self._selector(backbone, budget))

    def deploy(self, model: nn.Module) -> nn.Module:
        if isinstance(model, HeadPrunedModel):
            self.kept_heads = model.kept_heads()
            return model.deploy()
        return model

    def record(self) -> dict[str, Any]:
        """``kept_heads``: the deployed heads per layer (what :meth:`rebuild_deployed` reads)."""
        return {"kept_heads": self.kept_heads} if self.kept_heads is not None else {}

    def deployed_head(self, backbone: nn.Module) -> tuple[nn.Module, str]:
        """The head and pooling of the deployed model: SAPER's linear probe on [CLS ‖ mean patch]."""
        return nn.Linear(2 * backbone.embed_dim, backbone.num_classes), "cls_mean"

    def rebuild_deployed(self, backbone: nn.Module, record: Mapping[str, Any]) -> nn.Module:
        """The deployed architecture of a completed run, for its saved weights: ``backbone`` (built
        from the run's config, any weights) pruned to the ledger's ``kept_heads``. Load the run's
        ``artifacts.weights`` into the result with ``load_state_dict`` (strict)."""
        if not record.get("kept_heads"):
            raise KeyError(f"run {record.get('run_id')} has no kept_heads in its ledger entry: it was not a "
                           "completed SAPER train run")
        head, pool = self.deployed_head(backbone)
        return prune_probe_model(backbone, record["kept_heads"], head, pool)


class DistillPair(nn.Module):
    """A head-pruned student and its frozen unpruned teacher. ``forward`` gives the student's
    k-NN features (its ``pool`` after the final norm); ``distill_targets`` the student's and
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
        return self.student(x)

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
    """``method=saper_kd``: the student's tokens regress onto the frozen teacher's; k-NN evaluation
    on ``knn_features``. The deployed model outputs those features."""

    objective: ClassVar[str] = "distill"

    def __init__(self, name: str = "saper_kd", alpha_start: float = 1.0, alpha_end: float = 0.01,
                 anneal_fraction: float = 0.7, trainable: str = "scores", loss: str = "mse",
                 knn_k: int = 20, knn_temperature: float = 0.07, knn_features: str = "cls"):
        super().__init__(name, alpha_start, alpha_end, anneal_fraction, trainable)
        self.loss, self.knn_k, self.knn_temperature = loss, int(knn_k), float(knn_temperature)
        self.knn_features = _choice("method.knn_features", knn_features, POOLS)

    def module_kwargs(self) -> dict[str, Any]:
        return {"loss": self.loss, "knn_k": self.knn_k, "knn_temperature": self.knn_temperature}

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        import copy

        teacher = copy.deepcopy(backbone)
        teacher.reset_classifier(0)
        selector = self._selector(backbone, budget)
        student = HeadPrunedModel(backbone, 0, selector, head=nn.Identity(), pool=self.knn_features)
        return DistillPair(student, teacher)

    def deploy(self, model: nn.Module) -> nn.Module:
        return super().deploy(model.student) if isinstance(model, DistillPair) else super().deploy(model)

    def deployed_head(self, backbone: nn.Module) -> tuple[nn.Module, str]:
        return nn.Identity(), self.knn_features


class KnnEval(Method):
    """``method=knn``: the unpruned, frozen backbone under the k-NN objective (the unpruned k-NN
    rows of SAPER's tables, measured by the same code as ``saper_kd``). Nothing trains: the run
    is zero epochs, then the k-NN test."""

    objective: ClassVar[str] = "distill"
    budget_kinds: ClassVar[tuple[str, ...]] = ("none",)

    def __init__(self, name: str = "knn", knn_k: int = 20, knn_temperature: float = 0.07, knn_features: str = "cls"):
        super().__init__(name)
        self.knn_k, self.knn_temperature = int(knn_k), float(knn_temperature)
        self.knn_features = _choice("method.knn_features", knn_features, POOLS)

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        super().validate_budget(budget, arch)
        require_vit(self.name, arch)

    def module_kwargs(self) -> dict[str, Any]:
        return {"knn_k": self.knn_k, "knn_temperature": self.knn_temperature}

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        set_trainable(backbone, "scores")
        return feature_model(backbone, self.knn_features)

    def stages(self, model: nn.Module) -> list[Stage]:
        return [Stage("main", self.objective, lambda: model, {"epochs": 0}, self.module_kwargs())]

    def rebuild_deployed(self, backbone: nn.Module, record: Mapping[str, Any]) -> nn.Module:
        return feature_model(backbone, self.knn_features)


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
        set_trainable(backbone, "scores")
        return ProbeModel(backbone, num_classes)

    def rebuild_deployed(self, backbone: nn.Module, record: Mapping[str, Any]) -> nn.Module:
        return ProbeModel(backbone, backbone.num_classes)
