"""``method=tome``: the Method glue (budget validation, apply) around :mod:`.patch`."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch.nn as nn

from vitexp.methods.base import Method, require_vit
from vitexp.methods.tome.merge import parse_r
from vitexp.methods.tome.patch import patch_tome


class ToMe(Method):
    """Token Merging: ``budget.r`` tokens merged in every block (an int, or a per-layer list).
    Works off the shelf (``backbone.pretrained`` and ``recipe.epochs`` as the run wants; a
    vitexp-flops or vitexp-bench run trains nothing) and trained with the classify objective."""

    objective = "classify"
    budget_kinds: ClassVar[tuple[str, ...]] = ("merge",)

    def __init__(self, name: str = "tome", prop_attn: bool = True):
        super().__init__(name)
        self.prop_attn = bool(prop_attn)

    @staticmethod
    def _r(budget: Mapping[str, Any]) -> Any:
        r = budget["r"]
        return int(r) if isinstance(r, (int, float, str)) else list(r)

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        from vitexp.errors import ConfigError

        super().validate_budget(budget, arch)
        require_vit(self.name, arch)
        try:
            parse_r(self._r(budget), int(arch["depth"]))
        except (TypeError, ValueError) as err:
            raise ConfigError(str(err)) from None

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        patch_tome(backbone, parse_r(self._r(budget), len(backbone.blocks)), self.prop_attn)
        return backbone
