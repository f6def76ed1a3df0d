"""The one resolve step at a command's top: a config checked (values, cross-group constraints, the
weights and the accelerator on this machine), its starting weights and earlier runs found, its method
built and its objective picked, handed down as :class:`Resolved` (docs/commands.md, "bad input")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from vitexp.errors import ConfigError
from vitexp.methods import Method
from vitexp.training.objectives import Objective, objective_for

LOGGER_KINDS = ("wandb", "csv", "none")


SCHEDULES = ("cosine", "step", "multistep", "none")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


@dataclass(frozen=True)
class Resolved:
    """A run's parts after :func:`resolve`: the checked config (``backbone.pretrained: run:<experiment>``
    pinned to ``run:<run_id>``), the method built once, the objective, the backbone's starting weights
    as a file (``None``: none). The earlier runs the method reads are already handed to the method."""

    cfg: DictConfig
    method: Method
    objective: Objective
    weights: str | None = None


def resolve(
    cfg: DictConfig,
    need_data: bool = True,
    method: Method | None = None,
    need_trainer: bool | None = None,
    runs: bool = False,
) -> Resolved:
    """:func:`validate`'s checks, then the parts a command hands down (:class:`Resolved`); ``runs``:
    the earlier runs the method reads are found now and handed to it (:meth:`~vitexp.methods.Method.lookup`),
    so a missing one fails before the run starts. Raises :class:`ConfigError` naming the key, or
    ``FileNotFoundError`` naming a missing earlier run."""
    method, weights = _checked(cfg, need_data, method, need_trainer)
    if runs:
        method.lookup(cfg, resolve_needs(method, cfg.results_dir))
    return Resolved(cfg, method, objective_for(cfg), None if weights is None else str(weights))


def resolve_needs(method: Method, results_dir: Any) -> dict[str, dict[str, Any]]:
    """The earlier runs the method reads (:meth:`vitexp.methods.Method.needs`), each the completed
    train run with that id, else the newest of that experiment (``FileNotFoundError`` naming the key)."""
    needs = method.needs()
    if not needs:
        return {}
    from vitexp.ledger import Ledger

    ledger = Ledger.load(results_dir)
    ledger.check(needs.values())
    return {key: ledger.find(ref, key) for key, ref in needs.items()}


#: The longest tag W&B takes (``wandb.init`` fails on a longer one).
MAX_TAG = 64


def validate(cfg: DictConfig, need_data: bool = True, method=None, need_trainer: bool | None = None):
    """:func:`resolve`'s checks alone: returns the method (``method`` when the caller built it, else
    built here once)."""
    return _checked(cfg, need_data, method, need_trainer)[0]


def _checked(cfg: DictConfig, need_data: bool = True, method=None, need_trainer: bool | None = None):
    """Check values and cross-group constraints; raise :class:`ConfigError` naming the key.
    Returns the method and the backbone's starting weights file (``None``: none).

    ``need_data=False`` (vitexp-flops, vitexp-bench) skips the dataset's location;
    ``need_trainer`` (default: ``need_data``) checks that this machine has the trainer's
    accelerator. A ``backbone.pretrained`` file is opened and loaded into the backbone
    (:mod:`vitexp.training.checkpoints`)."""
    from vitexp.methods import method_from_config
    from vitexp.models.factory import check_file
    from vitexp.runs.owner import resume_mode
    from vitexp.training.checkpoints import check_accelerator, check_backbone_weights

    _check(isinstance(cfg.name, str) and cfg.name != "", "name", "must be a non-empty string")
    resume_mode(cfg.get("resume", False))
    _check(
        cfg.logger.kind in LOGGER_KINDS, "logger.kind", f"{cfg.logger.kind!r} is not one of {LOGGER_KINDS}"
    )
    if cfg.logger.kind == "wandb":
        from vitexp.runs.loggers import wandb_mode

        wandb_mode(cfg.logger.get("mode"))  # a bad WANDB_MODE fails here, before anything starts
    for tag in cfg.logger.get("tags") or []:  # W&B refuses a longer tag once the run has started
        _check(
            isinstance(tag, str) and 0 < len(tag) <= MAX_TAG,
            "logger.tags",
            f"{tag!r} is not a tag of 1 to {MAX_TAG} characters (W&B's limit)",
        )

    bb = cfg.backbone
    arch = bb.arch
    _check(
        int(bb.img_size) > 0 and int(bb.img_size) % int(arch.patch_size) == 0,
        "backbone.img_size",
        f"{bb.img_size} must be a positive multiple of the patch size {arch.patch_size}",
    )
    weights = None
    if bb.pretrained:
        from vitexp.config.weights import is_tag
        from vitexp.config.weights import resolve as resolve_weights
        from vitexp.ledger import RUN_WEIGHTS_PREFIX, LedgerError, weights_file, weights_run

        try:
            if str(bb.pretrained).startswith(RUN_WEIGHTS_PREFIX):
                # pinned to the run found now: the ledger records which run's weights were loaded,
                # and building the model reads that one entry instead of the whole ledger again
                run = weights_run(str(bb.pretrained), cfg.results_dir)
                with open_dict(cfg):
                    bb.pretrained = RUN_WEIGHTS_PREFIX + run["run_id"]
                weights = weights_file(run, cfg.results_dir)
            else:
                weights = resolve_weights(str(bb.pretrained)) if is_tag(bb.pretrained) else bb.pretrained
        except (FileNotFoundError, LedgerError) as err:
            raise ConfigError(f"backbone.pretrained: {err}") from None
        check_file(weights, "backbone.pretrained")

    data = cfg.data
    _check(not OmegaConf.is_missing(data, "num_classes"), "data.num_classes", "required (data.num_classes=N)")
    _check(int(data.num_classes) >= 2, "data.num_classes", f"{data.num_classes} must be >= 2")
    if "root" in data.keys() and need_data and not data.get("generate"):
        _check(
            not OmegaConf.is_missing(data, "root"),
            "data.root",
            f"required for data={data.name} (data.root=/path/to/dataset)",
        )
        root = data.root
        package = (
            f" (installed by the Debian package {data.package}: apt-get install -y {data.package})"
            if data.get("package")
            else ""
        )
        _check(
            root is not None and Path(str(root)).expanduser().is_dir(),
            "data.root",
            f"dataset root not found: {root}{package}",
        )
    if "decoder" in data:
        from vitexp.data.tensor_images import DECODERS

        _check(data.decoder in DECODERS, "data.decoder", f"{data.decoder!r} is not one of {DECODERS}")
    if "split" in data:
        split = list(data.split)
        _check(
            len(split) == 3 and all(0 < s < 1 for s in split) and math.isclose(sum(split), 1.0),
            "data.split",
            f"{split} must be three fractions in (0, 1) summing to 1 (train, val, test)",
        )

    r = cfg.recipe
    _check(int(r.epochs) >= 1, "recipe.epochs", f"{r.epochs} must be >= 1")
    _check(int(r.batch_size) >= 1, "recipe.batch_size", f"{r.batch_size} must be >= 1")
    _check(
        int(data.get("num_workers", 0)) >= 0, "data.num_workers", f"{data.get('num_workers')} must be >= 0"
    )
    _check(float(r.lr) > 0, "recipe.lr", f"{r.lr} must be > 0")
    _check(
        0 <= float(r.warmup_epochs) < int(r.epochs),
        "recipe.warmup_epochs",
        f"{r.warmup_epochs} must be in [0, recipe.epochs={r.epochs})",
    )
    _check(
        0 <= float(r.label_smoothing) < 1, "recipe.label_smoothing", f"{r.label_smoothing} must be in [0, 1)"
    )
    _check(0 <= float(r.mixup) and 0 <= float(r.cutmix), "recipe.mixup/cutmix", "must be >= 0")
    _check(0 <= float(r.drop_path) < 1, "recipe.drop_path", f"{r.drop_path} must be in [0, 1)")
    _check(r.sched in SCHEDULES, "recipe.sched", f"{r.sched!r} is not one of {SCHEDULES}")
    objective_for(cfg).validate(cfg)

    _check_compile(cfg)
    _check(
        cfg.bench.device in ("auto", "cpu", "cuda"),
        "bench.device",
        f"{cfg.bench.device!r} is not one of ('auto', 'cpu', 'cuda')",
    )
    if cfg.bench.device == "cuda" and need_trainer is False:  # vitexp-bench: it runs on bench.device
        import torch

        _check(
            torch.cuda.is_available(),
            "bench.device=cuda",
            "this machine has no CUDA GPU (torch.cuda.is_available() is false); bench.device=cpu or auto",
        )

    if method is None:
        _check_bspf_spec(cfg)
    method = method or method_from_config(cfg.method)
    method.validate_budget(cfg.budget, {**arch, "img_size": int(bb.img_size)})
    if need_data if need_trainer is None else need_trainer:
        check_accelerator(cfg.trainer)
    if bb.pretrained:  # last: it builds the backbone
        check_backbone_weights(cfg, weights)
    return method, weights


#: ``compile.backend`` choices (``inductor`` generates code; the others only capture graphs).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def _check_compile(cfg: DictConfig) -> None:
    """The ``compile`` block (absent in a config recorded before it: compiled off)."""
    from vitexp.models.compiled import MODES

    block = cfg.get("compile")
    if block is None:
        return
    _check(block.mode in MODES, "compile.mode", f"{block.mode!r} is not one of {MODES}")
    _check(
        block.backend in COMPILE_BACKENDS,
        "compile.backend",
        f"{block.backend!r} is not one of {COMPILE_BACKENDS}",
    )


def _check_bspf_spec(cfg: DictConfig) -> None:
    """A method that reads ``${bspf_spec.*}`` on a backbone without ``conf/bspf_spec/<backbone>.yaml``
    (the optional group Hydra selects by the backbone's name): a ConfigError saying what to set."""
    if "bspf_spec" in cfg:
        return
    for key, value in OmegaConf.to_container(cfg.method, resolve=False).items():
        if isinstance(value, str) and "${bspf_spec." in value:
            raise ConfigError(
                f"method.{key}: backbone={cfg.backbone.name} has no BSPF defaults "
                f"(conf/bspf_spec/{cfg.backbone.name}.yaml); add that file or set method.{key}=..."
            )
