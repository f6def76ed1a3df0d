"""``method=evit``: the Method glue (budget validation, apply) around :mod:`.patch`."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import torch.nn as nn

from vitexp.methods.base import Method, require_vit
from vitexp.methods.evit.patch import KeepRateSchedule, patch_evit


class EViT(Method):
    """EViT: after the attention of blocks ``prune_layers`` (0-based; None: depth·j//4 for
    j = 1, 2, 3, which on DeiT-S is EViT's 3, 6, 9 = blocks 4, 7, 10), keep the ⌈ρ·M⌉ most
    CLS-attended tokens and fuse the rest (``fuse_token``).
    ρ is ``budget.keep_ratio``; ``keep_warmup_start_epochs`` / ``keep_warmup_epochs`` are EViT's
    ``shrink_start_epoch`` / ``shrink_epochs`` (0 / 0: ρ from the first step, EViT's fine-tune
    script); ``epochs`` converts training progress to epochs (``${recipe.epochs}``)."""

    objective = "classify"
    budget_kinds: ClassVar[tuple[str, ...]] = ("keep_ratio",)

    def __init__(
        self,
        name: str = "evit",
        prune_layers: Sequence[int] | None = None,
        fuse_token: bool = True,
        keep_warmup_start_epochs: float = 0,
        keep_warmup_epochs: float = 0,
        epochs: int = 1,
    ):
        super().__init__(name)
        self.prune_layers = None if prune_layers is None else sorted(int(i) for i in prune_layers)
        self.fuse_token = bool(fuse_token)
        self.warmup_start, self.warmup = float(keep_warmup_start_epochs), float(keep_warmup_epochs)
        self.epochs = int(epochs)
        if self.warmup_start < 0 or self.warmup < 0:
            raise ValueError(
                f"method.keep_warmup_start_epochs={keep_warmup_start_epochs}, "
                f"method.keep_warmup_epochs={keep_warmup_epochs}: must be >= 0"
            )

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        from vitexp.errors import ConfigError

        super().validate_budget(budget, arch)
        require_vit(self.name, arch)
        if not 0 < float(budget["keep_ratio"]) <= 1:
            raise ConfigError(f"budget.keep_ratio: {budget['keep_ratio']} must be in (0, 1]")
        depth = int(arch["depth"])
        bad = [i for i in self.layers(depth) if not 0 <= i < depth]
        if bad:
            raise ConfigError(f"method.prune_layers: {bad} outside the backbone's layers 0..{depth - 1}")

    def layers(self, depth: int) -> list[int]:
        """The pruning blocks (0-based) on a backbone of ``depth`` blocks."""
        return self.prune_layers if self.prune_layers is not None else [depth * j // 4 for j in (1, 2, 3)]

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        schedule = KeepRateSchedule(float(budget["keep_ratio"]), self.warmup_start, self.warmup, self.epochs)
        return patch_evit(backbone, self.layers(len(backbone.blocks)), schedule, self.fuse_token)
