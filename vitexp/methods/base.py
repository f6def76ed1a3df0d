"""The method interface every method (baseline, BSPF, SAPER, RAPTOR) implements."""
from __future__ import annotations

import abc
from typing import Any, ClassVar, Mapping

import torch.nn as nn


class Method(abc.ABC):
    """Turns a backbone into the model to train.

    Subclasses set ``objective`` (which LightningModule of ``vitexp.module.OBJECTIVE_MODULES``
    trains the result) and
    ``budget_kinds`` (the ``budget`` group options they accept), and take their knobs as named
    constructor arguments (the keys of their ``conf/method/*.yaml``).
    """

    objective: ClassVar[str] = "classify"
    budget_kinds: ClassVar[tuple[str, ...]] = ("none",)

    def __init__(self, name: str):
        self.name = name

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        """Raise ``ConfigError`` if ``budget`` does not fit this method on a backbone with
        architecture facts ``arch`` (depth, num_heads, embed_dim, ...)."""
        from vitexp.config import ConfigError

        if budget["kind"] not in self.budget_kinds:
            raise ConfigError(
                f"budget={budget['kind']}: method {self.name} accepts budget kinds {list(self.budget_kinds)}"
            )

    @abc.abstractmethod
    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        """Return the model to train (may modify ``backbone`` in place)."""

    def module_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for the objective's LightningModule (e.g. the k-NN settings)."""
        return {}

    def deploy(self, model: nn.Module) -> nn.Module:
        """The trained model as deployed (pruned parts physically removed). Default: as is."""
        return model

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
