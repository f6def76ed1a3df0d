"""``method=raptor``: the Method glue (config knobs, phases from data, the run's stages)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.nn as nn

from vitexp.config.schema import recipe_keys
from vitexp.methods.base import Method, Stage, require_vit
from vitexp.methods.probe import ProbeModel
from vitexp.methods.raptor.distill import RaptorDistill
from vitexp.methods.raptor.phases import distance_matrix_from_data, even_phases, phases_for_blocks
from vitexp.methods.raptor.reference import ReferenceSurrogate, phases_from_thresholds, read_surrogate
from vitexp.methods.raptor.surrogate import MLP_KINDS, RaptorBlock, RaptorSurrogate

#: Recipe keys ``method.probe`` may set for the probe stages.
PROBE_RECIPE_KEYS = frozenset(
    {
        "epochs",
        "batch_size",
        "opt",
        "lr",
        "weight_decay",
        "sched",
        "warmup_epochs",
        "warmup_steps",
        "warmup_lr",
        "min_lr",
        "grad_clip",
    }
)
#: ``method.probe``'s type: those keys, typed as the recipe's (:func:`vitexp.config.schema.recipe_keys`).
ProbeRecipe = recipe_keys("ProbeRecipe", PROBE_RECIPE_KEYS)


def read_linear_head(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``weight`` (classes, 2d) and ``bias`` (classes,) of a linear-head checkpoint: a state dict
    with ``weight`` and ``bias``, as Meta's ``dinov2_vit*14_reg4_linear_head.pth``, or a saved vitexp
    probe (``head.weight``, ``head.bias``). The file is opened by :func:`vitexp.models.factory.check_file`
    (one line naming it: missing, empty, no torch file, pickled objects); a file without those keys
    is a :class:`~vitexp.errors.CheckpointError` too."""
    from vitexp.errors import CheckpointError
    from vitexp.models.factory import check_file

    path = Path(path).expanduser()
    state = check_file(path, "method.probe_head")
    for prefix in ("", "head."):
        weight, bias = state.get(f"{prefix}weight"), state.get(f"{prefix}bias")
        if isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor) and weight.dim() == 2:
            return weight, bias
    raise CheckpointError(
        f"method.probe_head: {path} is no linear head: expected a state dict with 'weight' and "
        f"'bias' (or 'head.weight' and 'head.bias'); found {sorted(map(str, state))[:8]}"
    )


def load_linear_head(path: str | Path, in_features: int, num_classes: int) -> nn.Linear:
    """The probe's Linear(2d → classes) from a linear-head checkpoint (:func:`read_linear_head`)."""
    weight, bias = read_linear_head(path)
    if tuple(weight.shape) != (num_classes, in_features) or tuple(bias.shape) != (num_classes,):
        raise ValueError(
            f"method.probe_head={path}: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} do not "
            f"fit the probe, which needs weight ({num_classes}, {in_features}) = (classes, 2 x embed_dim) "
            f"and bias ({num_classes},)"
        )
    head = nn.Linear(in_features, num_classes)
    head.load_state_dict({"weight": weight.float(), "bias": bias.float()})
    return head


class Raptor(Method):
    """``method=raptor``: a k-block recurrent surrogate of the (frozen) backbone; ``budget=blocks``.

    A run has four stages: stage 1 and stage 2 (``objective=raptor``; a stage of 0 epochs is
    skipped, and with both at 0 the probe sees the surrogate at initialisation; they distil on the
    training images under the evaluation transforms, as RAPTOR's precomputed teacher activations,
    unless ``method.distill_augment``), then the linear probe on
    the frozen surrogate (the run's top-1) and on the frozen teacher (``teacher_top1``), each with
    the ``method.probe`` recipe keys. ``method.teacher_probe_run`` names a completed probe run of
    the same teacher and data to take ``teacher_top1`` from instead.

    Both probes start from ``method.probe_head`` when it names a linear-head checkpoint (RAPTOR
    starts them from Meta's reg4 linear head), else from a fresh Linear. Each is evaluated once
    before training as well as after every epoch, and records the best of those validation
    accuracies (``best_val_top1``, RAPTOR's reported number) beside the final model's test
    accuracy (``top1``).

    ``surrogate`` starts the blocks from the reference code's files (:mod:`.reference`): a stage-2
    ``Raptor`` file, whose thresholds give the phases, or one stage-1 ``Block`` file per phase.
    Files without thresholds (stage-1 files, a ``Raptor`` saved as a state dict) require
    ``phases``: the layers each block was trained for are not in them, and phases from data or an
    even split would silently run the blocks on other layers. Every tensor of the files must have
    the size of vitexp's block (MLP hidden width 4 x dim), checked with the config.
    With ``stage1_epochs=0 stage2_epochs=0`` the run probes the reference's surrogate as it is."""

    objective: ClassVar[str] = "raptor"
    budget_kinds: ClassVar[tuple[str, ...]] = ("blocks",)

    def __init__(
        self,
        name: str = "raptor",
        phases: Sequence[Sequence[int]] | None = None,
        phase_images: int = 256,
        min_phase_size: int = 2,
        stage1_epochs: int = 1,
        stage2_epochs: int = 1,
        tau_fraction: float = 0.25,
        stage2_targets: str = "all_layers",
        cache_dir: str | None = None,
        probe: ProbeRecipe | None = None,
        teacher_probe: bool = True,
        teacher_probe_run: str | None = None,
        mlp: str = "swiglu",
        probe_head: str | None = None,
        surrogate: str | Sequence[str] | None = None,
        distill_augment: bool = False,
    ):
        super().__init__(name)
        self.distill_augment = bool(distill_augment)
        self.surrogate = (
            surrogate if surrogate is None or isinstance(surrogate, str) else [str(p) for p in surrogate]
        )
        self._reference: ReferenceSurrogate | None = None
        self.probe_head = probe_head
        self._initial_head: nn.Linear | None = None
        self.mlp = mlp
        self._num_classes = 1000
        self.phases = [list(p) for p in phases] if phases else None
        self.phases_source = "method.phases" if phases else None
        self.distance: torch.Tensor | None = None
        self.phase_images, self.min_phase_size = int(phase_images), int(min_phase_size)
        self.stage1_epochs, self.stage2_epochs = int(stage1_epochs), int(stage2_epochs)
        self.tau_fraction, self.stage2_targets = float(tau_fraction), stage2_targets
        self.cache_dir = cache_dir
        self.probe = dict(probe or {})
        self.teacher_probe, self.teacher_probe_run = bool(teacher_probe), teacher_probe_run

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        from vitexp.errors import ConfigError

        super().validate_budget(budget, arch)
        require_vit(self.name, arch)
        if arch.get("family", "vit") != "vit":
            raise ConfigError(
                f"method {self.name} does not apply to a {arch['family']} backbone: it needs a timm "
                "VisionTransformer (the DINOv2 or DeiT layout: patch embedding, prefix tokens, blocks, "
                "final norm)"
            )
        depth, k = int(arch["depth"]), int(budget["k"])
        if not 1 <= k <= depth // self.min_phase_size:
            raise ConfigError(
                f"budget.k: {k} blocks must be in [1, {depth // self.min_phase_size}] (depth {depth}, "
                f"phases of at least method.min_phase_size={self.min_phase_size} layers)"
            )
        if self.phases is not None:
            flat = [l for p in self.phases for l in p]
            if len(self.phases) != k or flat != list(range(depth)):
                raise ConfigError(
                    f"method.phases: {self.phases} must be {k} runs of consecutive layers covering "
                    f"0..{depth - 1} in order (budget.k={k})"
                )
        if self.stage1_epochs < 0 or self.stage2_epochs < 0:
            raise ConfigError(
                f"method.stage1_epochs={self.stage1_epochs} and method.stage2_epochs="
                f"{self.stage2_epochs} must be >= 0 (both 0: the untrained surrogate, a control)"
            )
        if self.stage2_targets not in ("all_layers", "final"):
            raise ConfigError(
                f"method.stage2_targets: {self.stage2_targets!r} is not one of ('all_layers', 'final')"
            )
        if self.mlp not in MLP_KINDS:
            raise ConfigError(f"method.mlp: {self.mlp!r} is not one of {MLP_KINDS}")
        unknown = sorted(set(self.probe) - PROBE_RECIPE_KEYS)
        if unknown:
            raise ConfigError(
                f"method.probe: unknown recipe keys {unknown}; valid keys are {sorted(PROBE_RECIPE_KEYS)}"
            )
        if not 0 <= self.tau_fraction <= 1:
            raise ConfigError(f"method.tau_fraction: {self.tau_fraction} must be in [0, 1]")
        if self.surrogate:
            self._check_reference(k, depth, arch)
        if (
            self.probe_head
        ):  # read before the run: one line naming the file (the class count is checked in apply)
            weight, _ = read_linear_head(self.probe_head)
            if "embed_dim" in arch and weight.shape[1] != 2 * int(arch["embed_dim"]):
                raise ConfigError(
                    f"method.probe_head: {self.probe_head} has weight {tuple(weight.shape)}; the probe "
                    f"reads [CLS, mean patch] features of 2 x embed_dim = {2 * int(arch['embed_dim'])}"
                )

    def reference(self) -> ReferenceSurrogate | None:
        """The ``surrogate`` files' blocks (read once), or None."""
        if self.surrogate and self._reference is None:
            self._reference = read_surrogate(self.surrogate)
        return self._reference

    def _check_reference(self, k: int, depth: int, arch: Mapping[str, Any]) -> None:
        """The reference blocks fit the budget, the MLP and (with thresholds) the phases."""
        from vitexp.errors import ConfigError

        try:
            ref = self.reference()
            phases = phases_from_thresholds(ref.thresholds, depth) if ref.thresholds is not None else None
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(str(err)) from None
        if len(ref.blocks) != k:
            raise ConfigError(f"method.surrogate: {ref.paths} hold {len(ref.blocks)} blocks, budget.k={k}")
        for key, theirs in (("embed_dim", ref.dim), ("num_heads", ref.heads)):
            if theirs is not None and key in arch and int(arch[key]) != theirs:
                raise ConfigError(
                    f"method.surrogate: the reference blocks have {key}={theirs}, the teacher "
                    f"{arch[key]} (backbone.arch.{key})"
                )
        if ref.mlp != self.mlp:
            raise ConfigError(
                f"method.surrogate: the reference blocks have a {ref.mlp} MLP, method.mlp={self.mlp}"
            )
        with torch.device("meta"):  # the block this run builds, shapes only
            shapes = {
                k: tuple(v.shape) for k, v in RaptorBlock(ref.dim, 1, mlp=self.mlp).state_dict().items()
            }
        for state, source in zip(ref.blocks, ref.sources):
            hidden, ours = state["mlp.fc2.weight"].shape[1], shapes["mlp.fc2.weight"][1]
            if hidden != ours:
                raise ConfigError(
                    f"method.surrogate={source}: its blocks' MLP hidden width is {hidden} (mlp_ratio "
                    f"{hidden / ref.dim:g}); vitexp's RAPTOR block has {ours} (mlp_ratio 4, the "
                    f"reference's default) at width {ref.dim}"
                )
            sizes = [
                f"{k} {tuple(v.shape)}, vitexp's {shapes[k]}"
                for k, v in state.items()
                if tuple(v.shape) != shapes[k]
            ]
            if sizes:
                raise ConfigError(
                    f"method.surrogate={source}: tensors of another size than vitexp's RAPTOR block: "
                    f"{'; '.join(sizes[:3])}"
                )
        if phases is not None and self.phases is not None and phases != self.phases:
            raise ConfigError(
                f"method.phases={self.phases} differ from the phases of {ref.paths} ({phases}, from its "
                f"thresholds {ref.thresholds})"
            )
        if ref.thresholds is None and self.phases is None:
            raise ConfigError(
                f"method.phases: required with method.surrogate={[Path(p).name for p in ref.paths]}, "
                "which hold no thresholds (stage-1 Block files, or a Raptor saved as a state dict): set "
                "it to the 0-based layers each block was trained for (a stage-1 run with --start_layer s "
                f"--end_layer e: s .. e-1), e.g. {even_phases(depth, k)}"
            )

    def prepare(self, backbone: nn.Module, datamodule: Any) -> None:
        """Phases from the teacher's layer distance matrix over ``phase_images`` training images."""
        ref = self.reference()
        if self.phases is not None or datamodule is None or (ref is not None and ref.thresholds is not None):
            return
        datamodule.setup("fit")
        device = torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"
        )  # before Lightning places the model
        self.distance = distance_matrix_from_data(
            backbone.to(device), datamodule.train_eval_dataloader(), self.phase_images
        )
        backbone.cpu()

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        k, depth = int(budget["k"]), len(backbone.blocks)
        ref = self.reference()
        if ref is not None:
            self._check_reference(
                k, depth, {"embed_dim": backbone.embed_dim, "num_heads": backbone.blocks[0].attn.num_heads}
            )
            if ref.thresholds is not None:
                self.phases = phases_from_thresholds(ref.thresholds, depth)
                self.phases_source = (
                    f"thresholds {ref.thresholds} of the reference surrogate {Path(ref.paths[0]).name}"
                )
        if self.phases is None and self.distance is not None:
            self.phases = phases_for_blocks(self.distance, k, self.min_phase_size)
            self.phases_source = (
                f"max-cut of the layer distance matrix over {self.phase_images} training images"
            )
        phases = self.phases
        if phases is None:
            phases, self.phases_source = (
                even_phases(depth, k),
                "even split (no data: FLOPs and throughput only)",
            )
        teacher = backbone
        self._num_classes = int(teacher.num_classes)
        if self.probe_head:  # read now: a wrong file fails before any training
            self._initial_head = load_linear_head(self.probe_head, 2 * teacher.embed_dim, self._num_classes)
        teacher.reset_classifier(0)
        surrogate = RaptorSurrogate(teacher, phases, self.mlp)
        if ref is not None:
            for block, state in zip(surrogate.blocks, ref.blocks):
                block.load_state_dict(state, strict=True)
        return RaptorDistill(teacher, surrogate, self.cache_dir, self.tau_fraction, self.stage2_targets)

    def rebuild_overrides(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """The run's recorded phases (chosen from the teacher's weights or the reference's
        thresholds); no probe head or reference files: the saved weights replace what they start."""
        phases = record.get("phases") or self.phases
        return {
            "probe_head": None,
            "surrogate": None,
            "phases": [list(p) for p in phases] if phases else None,
        }

    def record(self) -> dict[str, Any]:
        """What the ledger keeps of the method's data-dependent choices."""
        out: dict[str, Any] = {"phases": self.phases, "phases_source": self.phases_source}
        if self.surrogate:
            out["surrogate_files"] = [
                Path(p).name for p in self.reference().paths
            ]  # no machine paths in the ledger
        if self.distance is not None:
            out["distance_matrix"] = [[round(float(v), 6) for v in row] for row in self.distance]
        return out

    def needs(self) -> dict[str, str]:
        """``method.teacher_probe_run``, when set: the completed train run (id or experiment) to read."""
        return {"method.teacher_probe_run": self.teacher_probe_run} if self.teacher_probe_run else {}

    def lookup(self, cfg: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> None:
        """``teacher_top1`` from the run ``method.teacher_probe_run`` resolved to (``runs``), which
        must have this run's backbone and data."""
        self.teacher_metrics: dict[str, Any] = {}
        run_id = self.teacher_probe_run
        run = runs.get("method.teacher_probe_run")
        if not run_id or run is None:
            return
        for key in ("backbone", "data"):
            theirs, ours = run["config"].get(key, {}).get("name"), cfg[key]["name"]
            if theirs != ours:
                raise ValueError(
                    f"method.teacher_probe_run={run_id}: that run's {key} is {theirs}, this run's is {ours}"
                )
        self.teacher_metrics = {
            "teacher_top1": run["metrics"]["top1"],
            "teacher_top5": run["metrics"].get("top5"),
            "teacher_probe_run": run["run_id"],
        }

    def extra_metrics(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """The teacher's probe (looked up, or this run's ``teacher_top1``) and ``recovered`` =
        surrogate top-1 / teacher top-1."""
        out = dict(getattr(self, "teacher_metrics", {}))
        teacher = out.get("teacher_top1", metrics.get("teacher_top1"))
        if teacher and metrics.get("top1") is not None:
            out["recovered"] = metrics["top1"] / teacher
        return out

    def initial_head(self) -> nn.Linear | None:
        """A copy of the ``method.probe_head`` Linear for one probe (None: the probe's fresh Linear)."""
        return copy.deepcopy(self._initial_head) if self._initial_head is not None else None

    def stages(self, model: nn.Module) -> list[Stage]:
        def surrogate_probe() -> nn.Module:
            surrogate = model.surrogate
            for p in surrogate.parameters():
                p.requires_grad_(False)
            return ProbeModel(surrogate, self._num_classes, head=self.initial_head())

        def teacher_probe() -> nn.Module:
            return ProbeModel(copy.deepcopy(model.teacher), self._num_classes, head=self.initial_head())

        stages = []
        if self.stage1_epochs > 0:
            stages.append(
                Stage(
                    "stage1",
                    "raptor",
                    lambda: model,
                    {"epochs": self.stage1_epochs},
                    {"stage": 1},
                    metrics_prefix=None,
                    deployed=False,
                    augment=self.distill_augment,
                )
            )
        if self.stage2_epochs > 0:
            stages.append(
                Stage(
                    "stage2",
                    "raptor",
                    lambda: model,
                    {"epochs": self.stage2_epochs},
                    {"stage": 2},
                    metrics_prefix=None,
                    deployed=False,
                    augment=self.distill_augment,
                )
            )
        stages.append(
            Stage(
                "probe",
                "classify",
                surrogate_probe,
                self.probe,
                metrics_prefix="",
                deployed=True,
                best_val=True,
            )
        )
        if self.teacher_probe and not self.teacher_probe_run:
            stages.append(
                Stage(
                    "teacher_probe",
                    "classify",
                    teacher_probe,
                    self.probe,
                    metrics_prefix="teacher_",
                    deployed=False,
                    best_val=True,
                )
            )
        return stages

    def deploy(self, model: nn.Module) -> nn.Module:
        if isinstance(model, RaptorDistill):
            return ProbeModel(model.surrogate, self._num_classes)
        return model
