"""The method interface every method (baseline, BSPF, SAPER, RAPTOR) implements."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

import torch.nn as nn


@dataclass
class Stage:
    """One ``Trainer.fit`` of a run. Most methods train in one stage; RAPTOR trains its surrogate
    in two, then probes it and its teacher.

    - ``name``: checkpoints go to ``checkpoints/`` for ``main``, else ``checkpoints/<name>/``.
    - ``model``: called when the stage starts (it may wrap what earlier stages trained).
    - ``recipe``: keys that replace the run's ``recipe`` for this stage (``epochs``, ``lr``, ...),
      merged over it in one place (:func:`vitexp.training.fit.stage_config`).
    - ``metrics_prefix``: the stage is tested and its accuracies are recorded as ``<prefix>top1``
      ...; ``""`` is the run's own top-1; ``None`` means no test.
    - ``deployed``: this stage's trained model is the one FLOPs and throughput measure.
    - ``augment``: the stage trains on the training augmentations; False: on the evaluation
      transforms of the training images, in the same order (RAPTOR's distillation).
    - ``soft_prefix``: the stage trains another model than the one :meth:`Method.deploy` gives
      (SAPER's soft gates): it is tested too, as ``<soft_prefix>top1`` ..., and its validation
      accuracy is ``<soft_prefix>val_top1``. ``None``: the model trained is tested as deployed.
    - ``best_val``: the stage is also validated once before training (RAPTOR's probes). Every
      tested stage records its best ``val/top1`` over its validations as ``<prefix>best_val_top1``
      and the epochs trained when it was reached as ``<prefix>best_val_epoch``.
    """

    name: str
    objective: str
    model: Callable[[], nn.Module]
    recipe: Mapping[str, Any] = field(default_factory=dict)
    module_kwargs: Mapping[str, Any] = field(default_factory=dict)
    metrics_prefix: str | None = ""
    deployed: bool = True
    best_val: bool = False
    soft_prefix: str | None = None
    augment: bool = True


class Method(abc.ABC):
    """Turns a backbone into the model to train.

    Subclasses set ``objective`` (which LightningModule of ``vitexp.training.modules.OBJECTIVE_MODULES``
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
        from vitexp.errors import ConfigError

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

    def prepare(self, backbone: nn.Module, datamodule: Any) -> None:
        """Look at the training data before ``apply`` (RAPTOR's phases). Default: nothing."""

    def stages(self, model: nn.Module) -> list[Stage]:
        """The fits of a run, in order. Default: one stage training ``model`` with ``objective``."""
        return [Stage("main", self.objective, lambda: model, module_kwargs=self.module_kwargs())]

    def deployed_stage(self, model: nn.Module) -> Stage:
        """The stage whose trained model the run deploys: the last of :meth:`stages` with ``deployed``."""
        return [s for s in self.stages(model) if s.deployed][-1]

    def needs(self) -> dict[str, str]:
        """The earlier runs this run reads: {config key: run id or experiment} (RAPTOR's
        ``method.teacher_probe_run``). The run resolves them through the ledger before any training
        (a missing one fails first) and hands the records to :meth:`lookup`: a method never reads
        storage. Default: none."""
        return {}

    def lookup(self, cfg: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> None:
        """Take what the run needs from the earlier runs :meth:`needs` named, resolved to their
        ledger records (``runs``: {config key: record}). ``cfg``: the run's config. Default: nothing."""

    def extra_metrics(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Metrics of this method beside the run's own, from ``metrics`` and what :meth:`lookup`
        read (RAPTOR: the teacher's probe and the ``recovered`` fraction). Default: none."""
        return {}

    def record(self) -> dict[str, Any]:
        """Data-dependent choices the ledger entry keeps beside the metrics (RAPTOR's phases). Default:
        none."""
        return {}

    def deploy(self, model: nn.Module) -> nn.Module:
        """The trained model as deployed (pruned parts physically removed). Default: as is."""
        return model

    def rebuild_overrides(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """``method`` keys to set when a completed run's deployed model is rebuilt for its saved
        weights (``vitexp-eval``): files that only initialise weights the saved ones replace set to
        None (they may not be on this machine), and data-dependent choices the ledger ``record``
        kept (RAPTOR's phases, which the teacher's weights chose). Default: none."""
        return {}

    def rebuild_deployed(self, backbone: nn.Module, record: Mapping[str, Any]) -> nn.Module:
        """The architecture of a completed run's deployed model, for its saved weights
        (``record["artifacts"]["weights"]``, loaded with ``load_state_dict``). ``backbone`` is built
        from the run's config (:meth:`rebuild_overrides` applied) and prepared (:meth:`prepare`);
        ``record`` is the run's ledger entry, whose :meth:`record` keys say what data-dependent
        choices to repeat (SAPER's ``kept_heads``). ``vitexp-eval`` always calls it. Default: the
        deployed stage's model (:meth:`deployed_stage`) of ``apply(backbone, budget)``, as
        :meth:`deploy` gives it, right for methods whose architecture does not depend on training."""
        return self.deploy(self.deployed_stage(self.apply(backbone, record["config"]["budget"])).model())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def check_choice(key: str, value: str, valid: tuple[str, ...]) -> str:
    """``value`` when it is one of ``valid``, else ``ConfigError`` naming the key and the valid choices."""
    from vitexp.errors import ConfigError

    if value not in valid:
        raise ConfigError(f"{key}={value!r}: valid choices are {list(valid)}")
    return value


def require_vit(method: str, arch: Mapping[str, Any]) -> None:
    """``ConfigError`` unless the backbone is a ViT: the methods that read a ViT's blocks, CLS and
    patch tokens (SAPER, the probe and k-NN rows, RAPTOR, ToMe, EViT) name the family they refuse."""
    from vitexp.errors import ConfigError

    family = {"metaformer": "MetaFormer", "shvit": "SHViT"}.get(arch.get("family", "vit"))
    if family:
        raise ConfigError(
            f"method {method} does not apply to a {family} backbone: it needs a ViT's blocks and "
            "CLS token (use a DINOv2, DeiT, T2T-ViT or LV-ViT backbone)"
        )
