"""The interface every objective implements: the model to measure, how to train it (its stages and their
LightningModule), how to test it (the metrics of a test or a validation), how to count it (FLOPs and
params under its protocol), and how a completed run's model is rebuilt for its weights.

Its reasoning: docs/commands.md, "vitexp/training/objectives/base.py".
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

if TYPE_CHECKING:
    import lightning as L
    import torch.nn as nn
    from omegaconf import DictConfig

    from vitexp.methods import Method, Stage


@dataclass
class Count:
    """FLOPs and params of a model under an objective's protocol: the ledger's ``metrics``,
    ``protocol`` and ``by_module``; ``where`` (the resolution) and ``parts`` (GMACs by part) are
    what ``vitexp-flops`` prints."""

    metrics: dict[str, Any]
    protocol: dict[str, Any]
    where: str
    parts: Mapping[str, float] = field(default_factory=dict)
    by_module: Mapping[str, float] = field(default_factory=dict)


class Objective(abc.ABC):
    """One choice of the config's ``objective`` key (:data:`vitexp.training.objectives.OBJECTIVES`)."""

    #: The ``objective`` choice.
    name: ClassVar[str]
    #: The metrics that say how well a run did (what ``vitexp-eval`` prints beside the run's).
    headline: ClassVar[tuple[str, ...]]
    #: The ``data`` option a rehearsal of this objective trains on (synthetic images of its kind).
    synthetic_data: ClassVar[str]
    #: {config group: schema dataclass} of the groups this objective owns (:mod:`vitexp.config.schema`).
    config_groups: ClassVar[Mapping[str, type]] = {}

    def validate(self, cfg: DictConfig) -> None:
        """Rules across groups this objective needs (a :class:`~vitexp.errors.ConfigError` naming
        the key). Default: none."""

    @abc.abstractmethod
    def stages(
        self, cfg: DictConfig, method: Method, model: nn.Module, data_config: Mapping[str, Any]
    ) -> list[Stage]:
        """The fits of a run of ``model`` (the backbone with ``method`` applied), in order."""

    @abc.abstractmethod
    def module_class(self, stage: Stage) -> type[L.LightningModule]:
        """The LightningModule that trains and tests ``stage``."""

    def module(self, scfg: DictConfig, stage: Stage, model: nn.Module | None = None) -> L.LightningModule:
        """``stage``'s LightningModule around ``model`` (default: the stage's own); ``scfg`` is the
        stage's config (:func:`vitexp.training.fit.stage_config`), whose ``compile`` block the module
        compiles the model with (:meth:`vitexp.training.modules.ObjectiveModule.set_compile`)."""
        from vitexp.models.compiled import CompileOptions

        module = self.module_class(stage)(
            stage.model() if model is None else model,
            num_classes=int(scfg.data.num_classes),
            recipe=scfg.recipe,
            **dict(stage.module_kwargs),
        )
        if hasattr(module, "set_compile"):
            module.set_compile(CompileOptions.of(scfg.get("compile")))
        return module

    def test(
        self, trainer: L.Trainer, module: L.LightningModule, datamodule, prefix: str = ""
    ) -> dict[str, Any]:
        """The test split's metrics of ``module``, keyed ``<prefix><metric>`` (:meth:`test_metrics`)."""
        return self.test_metrics(trainer.test(module, datamodule=datamodule, verbose=False)[0], prefix)

    @abc.abstractmethod
    def test_metrics(self, logged: Mapping[str, float], prefix: str) -> dict[str, Any]:
        """The ledger's metrics from what a test logged (``test/...``, fractions), in %."""

    @abc.abstractmethod
    def validation_metrics(self, logged: Mapping[str, float], prefix: str) -> dict[str, Any]:
        """The ledger's ``<prefix>val_...`` metrics from the last validation's ``val/...`` values."""

    @abc.abstractmethod
    def measured(self, cfg: DictConfig, deployed: nn.Module, data_config: Mapping[str, Any]) -> nn.Module:
        """The model this objective counts, around the method's deployed model (``vitexp-flops``)."""

    @abc.abstractmethod
    def count(self, cfg: DictConfig, model: nn.Module) -> Count:
        """FLOPs, params and heads of the measured ``model`` under this objective's protocol."""

    @abc.abstractmethod
    def deployed_cost(self, cfg: DictConfig, model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        """(metrics, protocol) of a trained run's deployed ``model``, at the end of the run."""

    def rebuild(
        self,
        cfg: DictConfig,
        method: Method,
        backbone: nn.Module,
        record: Mapping[str, Any],
        data_config: Mapping[str, Any],
    ) -> tuple[Stage, nn.Module]:
        """The stage whose model the completed run ``record`` deployed (its LightningModule, settings,
        metrics prefix and recipe), and that model's architecture for the run's saved weights.
        ``backbone`` is built from the run's config and prepared (:meth:`Method.prepare`); the
        method rebuilds its deployed model on it (:meth:`Method.rebuild_deployed`). The stage is read
        off the model as training had it, ``apply(backbone)`` before deployment (on a copy, since
        ``apply`` patches the backbone in place): a method's ``stages`` may depend on that model
        (which parameters train), and the deployed model differs from it."""
        import copy

        stage = method.deployed_stage(method.apply(copy.deepcopy(backbone), record["config"]["budget"]))
        return stage, method.rebuild_deployed(backbone, record)

    def dataset_sizes(self, data: Mapping[str, Any]) -> dict[str, int] | None:
        """{train, val, test} images of a dataset this objective builds itself from ``data`` (a
        generated one), for :mod:`vitexp.cost`; ``None``: none (the named datasets are
        :data:`vitexp.cost.DATASETS`)."""
        return None

    def cost_anchor(self, config: Mapping[str, Any]) -> str | None:
        """The ``conf/cost.yaml`` anchor a row of this objective is timed from (:mod:`vitexp.cost`);
        ``None``: its backbone's. Default: ``None``."""
        return None

    def check_timed(self, cfg: DictConfig) -> None:
        """Raise :class:`~vitexp.errors.ConfigError` when ``vitexp-bench`` cannot time this
        objective's model (a forward on a batch of images at ``backbone.img_size``). Default: it can."""

    @abc.abstractmethod
    def rehearsal_data(self, config: Mapping[str, Any], n_train: int, n_eval: int) -> list[str]:
        """The ``data`` overrides of a row's rehearsal (:mod:`vitexp.cost.rehearsal.plan`): synthetic data
        of the row's shape and classes, ``n_train`` training and ``n_eval`` evaluation samples."""
