"""``method=knn``: the unpruned k-NN rows of SAPER's tables, measured by ``saper_kd``'s code."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch.nn as nn

from vitexp.methods.base import Method, Stage, check_choice, require_vit
from vitexp.methods.probe import POOLS, feature_model


class KnnEval(Method):
    """``method=knn``: the unpruned, frozen backbone under the k-NN objective (the unpruned k-NN
    rows of SAPER's tables, measured by the same code as ``saper_kd``). Nothing trains: the run
    is zero epochs, then the k-NN test on ``knn_features`` (``cls``: DINO's k-NN evaluation uses
    the CLS token only; ``cls_mean``: [CLS ‖ mean patch])."""

    objective: ClassVar[str] = "distill"
    budget_kinds: ClassVar[tuple[str, ...]] = ("none",)

    def __init__(
        self, name: str = "knn", knn_k: int = 20, knn_temperature: float = 0.07, knn_features: str = "cls"
    ):
        super().__init__(name)
        self.knn_k, self.knn_temperature = int(knn_k), float(knn_temperature)
        self.knn_features = check_choice("method.knn_features", knn_features, POOLS)

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        super().validate_budget(budget, arch)
        require_vit(self.name, arch)

    def module_kwargs(self) -> dict[str, Any]:
        return {"knn_k": self.knn_k, "knn_temperature": self.knn_temperature}

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        backbone.requires_grad_(False)
        return feature_model(backbone, self.knn_features)

    def stages(self, model: nn.Module) -> list[Stage]:
        return [Stage("main", self.objective, lambda: model, {"epochs": 0}, self.module_kwargs())]

    def rebuild_deployed(self, backbone: nn.Module, record: Mapping[str, Any]) -> nn.Module:
        return feature_model(backbone, self.knn_features)
