"""The probe model SAPER, RAPTOR and the unpruned reference rows share, and ``method=probe``.

- **Probe model** (SAPER's head). A linear classifier on [CLS ‖ mean of patch tokens] after the
  backbone's final norm; register tokens are excluded from the mean. Its MACs are counted with
  the model's.
- **k-NN features** (``pool="cls"``: DINO's k-NN evaluation uses the CLS token only;
  ``"cls_mean"``: [CLS ‖ mean patch]): the same model with no linear head (:func:`feature_model`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
import torch.nn as nn

from vitexp.methods.base import Method, require_vit

#: Token pooling of a probe or k-NN feature: [CLS ‖ mean of patch tokens], or CLS alone.
POOLS = ("cls_mean", "cls")


def pool_tokens(tokens: torch.Tensor, pool: str, num_prefix_tokens: int) -> torch.Tensor:
    """(B, N, d) tokens after the final norm -> (B, 2d) [CLS ‖ mean of the patch tokens] (prefix
    tokens, i.e. CLS and registers, left out of the mean) or (B, d) CLS."""
    if pool == "cls":
        return tokens[:, 0]
    return torch.cat([tokens[:, 0], tokens[:, num_prefix_tokens:].mean(dim=1)], dim=-1)


class ProbeModel(nn.Module):
    """Backbone features -> ``head``. ``pool="cls_mean"``: [CLS ‖ mean of patch tokens] (SAPER's
    linear head, Linear(2d -> classes)); ``pool="cls"``: the CLS token. With ``head=nn.Identity()``
    the output is the feature vector itself (a k-NN classifier's input)."""

    def __init__(
        self, backbone: nn.Module, num_classes: int, head: nn.Module | None = None, pool: str = "cls_mean"
    ):
        super().__init__()
        if pool not in POOLS:
            raise ValueError(f"pool={pool!r}: valid choices are {POOLS}")
        backbone.reset_classifier(0)
        self.backbone = backbone
        self.pool = pool
        self.num_prefix_tokens = int(getattr(backbone, "num_prefix_tokens", 1))
        width = backbone.embed_dim * (2 if pool == "cls_mean" else 1)
        self.head = head if head is not None else nn.Linear(width, num_classes)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's tokens after its final norm (what SAPER's distillation compares)."""
        return self.backbone.forward_features(x)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return pool_tokens(self.backbone.forward_features(x), self.pool, self.num_prefix_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def feature_model(backbone: nn.Module, pool: str) -> ProbeModel:
    """The backbone's k-NN features (no linear head)."""
    return ProbeModel(backbone, 0, head=nn.Identity(), pool=pool)


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
        backbone.requires_grad_(False)
        return ProbeModel(backbone, num_classes)

    def rebuild_deployed(self, backbone: nn.Module, record: Mapping[str, Any]) -> nn.Module:
        return ProbeModel(backbone, backbone.num_classes)
