"""SAPER's Method glue: ``method=saper_ft`` (:class:`SaperHeads`) and ``method=saper_kd``
(:class:`SaperDistill`), for every head-selection rule (``method.selection``).

Its reasoning: docs/reading-saper.md, "vitexp/methods/saper/method.py".
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Mapping

import torch
import torch.nn as nn

from vitexp.methods.base import Method, Stage, check_choice, require_vit
from vitexp.methods.probe import POOLS, ProbeModel
from vitexp.methods.saper.selection import (
    SELECTIONS,
    importance_scores,
    magnitude_scores,
    random_scores,
    top_k_heads,
)
from vitexp.methods.saper.selector import HeadPrunedModel, HeadSelector
from vitexp.methods.saper.surgery import ConstantBranch, prune_probe_model

#: What trains in ``select`` besides the head scores (method.trainable).
TRAINABLE = ("scores", "mlp", "non_attention", "all")
#: What trains in ``recover`` (method.recover_trainable); the probe always trains in fine-tune mode.
RECOVER_TRAINABLE = ("non_attention", "mlp", "all")


def set_trainable(backbone: nn.Module, trainable: str) -> None:
    """``scores``: every backbone weight frozen; ``mlp``: only the blocks' MLPs train (attention,
    norms, LayerScale, embeddings frozen); ``non_attention``: every weight but the blocks'
    attention (q, k, v and output projections) trains; ``all``: every backbone weight trains.
    A deployed layer with no head left (:class:`~vitexp.methods.saper.surgery.ConstantBranch`) also
    freezes its ``norm1``, which then feeds nothing: it could receive no gradient, and DDP (without
    ``find_unused_parameters``) refuses a trainable parameter that gets none (found by the DDP
    rehearsal of a full-size distill row, issue 28; on one process nothing changes: an optimizer
    skips a parameter without gradient)."""
    for p in backbone.parameters():
        p.requires_grad_(trainable in ("all", "non_attention"))
    for block in backbone.blocks:
        if trainable == "mlp":
            block.mlp.requires_grad_(True)
        if trainable == "non_attention":
            block.attn.requires_grad_(False)
        if isinstance(block.attn, ConstantBranch) and hasattr(block, "norm1"):
            block.norm1.requires_grad_(False)


class SaperHeads(Method):
    """Head selection under a head budget (``budget=heads``, ``budget.k``)."""

    objective: ClassVar[str] = "classify"
    budget_kinds: ClassVar[tuple[str, ...]] = ("heads",)

    def __init__(
        self,
        name: str = "saper_ft",
        alpha_start: float = 1.0,
        alpha_end: float = 0.01,
        anneal_fraction: float = 0.7,
        trainable: str = "scores",
        selection: str = "lapsum",
        selection_seed: int = 0,
        importance_batches: int = 8,
        recover_epochs: int = 0,
        recover_lr: float | None = None,
        recover_trainable: str = "non_attention",
        straight_through: bool = False,
        fold_gates: bool = False,
    ):
        from vitexp.errors import ConfigError

        super().__init__(name)
        self.alpha_start, self.alpha_end = float(alpha_start), float(alpha_end)
        self.anneal_fraction = float(anneal_fraction)
        self.trainable = check_choice("method.trainable", trainable, TRAINABLE)
        self.selection = check_choice("method.selection", selection, SELECTIONS)
        self.selection_seed, self.importance_batches = int(selection_seed), int(importance_batches)
        if self.importance_batches < 1:
            raise ConfigError(f"method.importance_batches: {importance_batches} must be >= 1")
        self.recover_epochs = int(recover_epochs)
        if self.recover_epochs < 0:
            raise ConfigError(f"method.recover_epochs: {recover_epochs} must be >= 0 (0: no recovery stage)")
        self.recover_lr = None if recover_lr is None else float(recover_lr)
        if self.recover_lr is not None and not self.recover_lr > 0:
            raise ConfigError(f"method.recover_lr: {recover_lr} must be > 0 (null: the recipe's lr)")
        self.recover_trainable = check_choice(
            "method.recover_trainable", recover_trainable, RECOVER_TRAINABLE
        )
        self.straight_through, self.fold_gates = bool(straight_through), bool(fold_gates)
        if self.fold_gates and self.selection != "lapsum":
            raise ConfigError(
                f"method.fold_gates: true folds LapSum's gates; selection={selection} has none "
                "(fold_gates applies to selection=lapsum only)"
            )
        self.kept_heads: list[list[int]] | None = None
        self.importance: torch.Tensor | None = None
        self.selection_source: str | None = None
        self.gate_summary: dict[str, float] | None = None

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        from vitexp.errors import ConfigError

        super().validate_budget(budget, arch)
        require_vit(self.name, arch)
        total = int(arch["depth"]) * int(arch["num_heads"])
        if not 1 <= int(budget["k"]) < total:
            raise ConfigError(
                f"budget.k: {budget['k']} heads must be in [1, {total - 1}] (the backbone has {total} heads)"
            )

    def prepare(self, backbone: nn.Module, datamodule: Any) -> None:
        """``selection=importance``: the heads' importance over the calibration batches."""
        if self.selection == "importance" and datamodule is not None:
            self.importance = importance_scores(
                backbone, datamodule, self.importance_batches, self.selection_seed, self.feature_pool
            )

    def fixed_head_scores(self, backbone: nn.Module) -> torch.Tensor:
        """(L, H) scores of a rule fixed before training; its top k are kept. Without data
        (``vitexp-flops``, ``vitexp-bench``: ``prepare`` not run) ``importance`` falls back to
        ``random``, which keeps as many heads (the same MACs unless a layer loses all of them)."""
        depth, heads = len(backbone.blocks), backbone.blocks[0].attn.num_heads
        if self.selection == "magnitude":
            self.selection_source = "output-projection column norms"
            return magnitude_scores(backbone)
        if self.selection == "importance" and self.importance is not None:
            self.selection_source = (
                f"importance over {self.importance_batches} calibration batches (seed {self.selection_seed})"
            )
            return self.importance
        self.selection_source = f"random (seed {self.selection_seed})" + (
            "" if self.selection == "random" else "; importance without data: FLOPs and throughput only"
        )
        return random_scores(depth, heads, self.selection_seed)

    def student(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        """The model that trains, under the deployed model's head and pooling: LapSum's gated
        model, or the backbone already pruned to the fixed rule's k heads."""
        if self.selection == "lapsum":
            set_trainable(backbone, self.trainable)
            depth, heads = len(backbone.blocks), backbone.blocks[0].attn.num_heads
            selector = HeadSelector(
                depth,
                heads,
                int(budget["k"]),
                self.alpha_start,
                self.alpha_end,
                self.anneal_fraction,
                self.straight_through,
                self.fold_gates,
            )
            head, pool = self.deployed_head(backbone)
            return HeadPrunedModel(backbone, 0, selector, head=head, pool=pool)
        self.kept_heads = top_k_heads(self.fixed_head_scores(backbone), int(budget["k"]))
        model = prune_probe_model(backbone, self.kept_heads, *self.deployed_head(backbone))
        set_trainable(model.backbone, self.trainable)  # after pruning: the pruned projections are new Linears
        return model

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        return self.student(backbone, budget)

    def stages(self, model: nn.Module) -> list[Stage]:
        """``select`` (zero epochs when nothing trains: fixed heads, ``trainable=scores``, no
        probe), then ``recover`` unless ``recover_epochs`` is 0 (module docstring)."""
        recover = self.recover_epochs > 0
        select = Stage(
            "select",
            self.objective,
            lambda: model,
            {} if any(p.requires_grad for p in model.parameters()) else {"epochs": 0},
            self.module_kwargs(),
            metrics_prefix="selected_" if recover else "",
            deployed=not recover,
            soft_prefix="soft_" if self.selection == "lapsum" else None,
        )
        if not recover:
            return [select]
        recipe = {"epochs": self.recover_epochs, **({"lr": self.recover_lr} if self.recover_lr else {})}
        return [
            select,
            Stage(
                "recover",
                self.objective,
                lambda: self.recovery_model(model),
                recipe,
                self.module_kwargs(),
                metrics_prefix="",
                deployed=True,
            ),
        ]

    def recovery_model(self, selected: nn.Module) -> nn.Module:
        """The model ``recover`` trains: the deployed model of ``selected`` (what ``select``
        trained, its probe included) with ``recover_trainable`` set; the probe trains."""
        deployed = self.deploy(selected)
        set_trainable(deployed.backbone, self.recover_trainable)
        deployed.head.requires_grad_(True)
        return deployed

    def deploy(self, model: nn.Module) -> nn.Module:
        if isinstance(model, HeadPrunedModel):
            self.kept_heads = model.kept_heads()
            self.gate_summary = model.selector.gate_summary()
            return model.deploy()
        return model

    def record(self) -> dict[str, Any]:
        """``kept_heads``: the deployed heads per layer (what :meth:`rebuild_deployed` reads);
        for a fixed rule also where they came from, and ``importance``'s normalised scores."""
        out: dict[str, Any] = {}
        if self.kept_heads is not None:
            out["kept_heads"] = self.kept_heads
        if self.selection_source:
            out["selection_source"] = self.selection_source
        if self.importance is not None:
            out["head_importance"] = [[round(float(v), 6) for v in row] for row in self.importance]
        if self.gate_summary is not None:
            out["gate_summary"] = self.gate_summary
        return out

    def extra_metrics(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Without ``recover`` the deployed model before recovery is the run's: ``selected_top1`` =
        ``top1``."""
        if "selected_top1" in metrics or metrics.get("top1") is None:
            return {}
        return {"selected_top1": metrics["top1"], "selected_top5": metrics.get("top5")}

    #: The deployed model's features: [CLS ‖ mean patch] under SAPER's linear probe.
    feature_pool: ClassVar[str] = "cls_mean"

    def deployed_head(self, backbone: nn.Module) -> tuple[nn.Module, str]:
        """The head and pooling of the deployed model: SAPER's linear probe on [CLS ‖ mean patch]."""
        return nn.Linear(2 * backbone.embed_dim, backbone.num_classes), self.feature_pool

    def rebuild_deployed(self, backbone: nn.Module, record: Mapping[str, Any]) -> nn.Module:
        """The deployed architecture of a completed run, for its saved weights: ``backbone`` (built
        from the run's config, any weights) pruned to the ledger's ``kept_heads``. Load the run's
        ``artifacts.weights`` into the result with ``load_state_dict`` (strict)."""
        if not record.get("kept_heads"):
            raise KeyError(
                f"run {record.get('run_id')} has no kept_heads in its ledger entry: it was not a "
                "completed SAPER train run"
            )
        head, pool = self.deployed_head(backbone)
        return prune_probe_model(backbone, record["kept_heads"], head, pool)


class DistillPair(nn.Module):
    """A head-pruned student and its frozen unpruned teacher. ``forward`` gives the student's
    k-NN features (its ``pool`` after the final norm); ``distill_targets`` the student's and
    teacher's tokens (CLS and patches; registers excluded)."""

    def __init__(self, student: ProbeModel, teacher: nn.Module):
        super().__init__()
        self.student = student
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def set_progress(self, fraction: float) -> None:
        if isinstance(self.student, HeadPrunedModel):
            self.student.set_progress(fraction)

    def train(self, mode: bool = True) -> "DistillPair":
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)

    def distill_targets(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.student.num_prefix_tokens
        s = self.student.tokens(x)
        with torch.no_grad():
            t = self.teacher.forward_features(x)
        keep = [0] + list(range(p, s.shape[1]))
        return s[:, keep], t[:, keep]


class SaperDistill(SaperHeads):
    """``method=saper_kd``: the student's tokens regress onto the frozen teacher's; k-NN evaluation
    on ``knn_features``. The deployed model outputs those features."""

    objective: ClassVar[str] = "distill"

    def __init__(
        self,
        name: str = "saper_kd",
        alpha_start: float = 1.0,
        alpha_end: float = 0.01,
        anneal_fraction: float = 0.7,
        trainable: str = "scores",
        selection: str = "lapsum",
        selection_seed: int = 0,
        importance_batches: int = 8,
        recover_epochs: int = 0,
        recover_lr: float | None = None,
        recover_trainable: str = "non_attention",
        straight_through: bool = False,
        loss: str = "mse",
        knn_k: int = 20,
        knn_temperature: float = 0.07,
        knn_features: str = "cls",
        fold_gates: bool = False,
    ):
        super().__init__(
            name,
            alpha_start,
            alpha_end,
            anneal_fraction,
            trainable,
            selection,
            selection_seed,
            importance_batches,
            recover_epochs,
            recover_lr,
            recover_trainable,
            straight_through,
            fold_gates,
        )
        self.loss, self.knn_k, self.knn_temperature = loss, int(knn_k), float(knn_temperature)
        self.knn_features = self.feature_pool = check_choice("method.knn_features", knn_features, POOLS)

    def module_kwargs(self) -> dict[str, Any]:
        return {"loss": self.loss, "knn_k": self.knn_k, "knn_temperature": self.knn_temperature}

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        teacher = copy.deepcopy(backbone)
        teacher.reset_classifier(0)
        return DistillPair(self.student(backbone, budget), teacher)

    def deploy(self, model: nn.Module) -> nn.Module:
        return super().deploy(model.student) if isinstance(model, DistillPair) else super().deploy(model)

    def recovery_model(self, selected: nn.Module) -> nn.Module:
        """The deployed student against the unpruned, frozen teacher of ``select``."""
        return DistillPair(super().recovery_model(selected), selected.teacher)

    def deployed_head(self, backbone: nn.Module) -> tuple[nn.Module, str]:
        """No head: the deployed student outputs its ``knn_features``."""
        return nn.Identity(), self.knn_features
