"""The unmodified backbone: the reference row of every table."""

from __future__ import annotations

from typing import Any, Mapping

import torch.nn as nn

from vitexp.methods.base import Method


class Baseline(Method):
    objective = "classify"
    budget_kinds = ("none",)

    def __init__(self, name: str = "baseline"):
        super().__init__(name)

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        return backbone
