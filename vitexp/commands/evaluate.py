"""``vitexp-eval``:

Its reasoning: docs/commands.md, "vitexp/commands/evaluate.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from omegaconf import DictConfig, OmegaConf, open_dict

from vitexp.config.weights import PREFIX as WEIGHTS_PREFIX
from vitexp.errors import CheckpointError, ConfigError, join_lines
from vitexp.ledger import (
    RUN_WEIGHTS_PREFIX,
    Ledger,
    default_results_dir,
    load_entry,
    local_path,
    portable_path,
    weights_file,
)
from vitexp.runs.loggers import fetch_model

#: Groups an evaluation may swap whole (where and how it runs, not what the model is).
SWAPPABLE_GROUPS = ("logger", "trainer")
#: The run's inputs that are paths on the machine it ran on (the ledger stores them portable).
PATH_KEYS = ("data.root", "backbone.pretrained")


#: Where W&B model artifacts are downloaded to (``<results>/wandb/``, which git ignores).
ARTIFACTS_SUBDIR = Path("wandb") / "artifacts"


def find_run(run: str, results_dir: Path) -> dict[str, Any]:
    """The completed train run with id ``run``, else the newest completed run of experiment ``run``,
    else the one completed train run whose id ends in ``-run`` (a short id: ``40f87a``);
    or, ``run`` a W&B model artifact reference (``[[ENTITY/]PROJECT/]NAME:ALIAS``, as the ledger's
    ``artifacts.wandb_model`` names it, so never a run id or an experiment), the ledger record the
    artifact carries, its weights downloaded: a run trained on another machine."""
    if ":" in run:
        return fetch_model(run, results_dir / ARTIFACTS_SUBDIR)
    pinned = load_entry(run, results_dir)  # a run id: that one entry, no scan of the ledger
    if pinned is not None and pinned.get("status") == "completed" and pinned.get("kind") == "train":
        return pinned
    ledger = Ledger.load(results_dir)
    ledger.check([run])
    found = ledger.newest(run, "train")
    if found is None:  # a short id, the hex tail that tables and reports print (``...-40f87a``)
        tails = [
            r
            for r in ledger.records
            if r["run_id"].endswith(f"-{run}") and r.get("kind") == "train" and r.get("status") == "completed"
        ]
        if len(tails) > 1:
            raise FileNotFoundError(
                f"short id {run!r} names {len(tails)} completed train runs "
                f"({', '.join(r['run_id'] for r in tails)}); give the full id"
            )
        found = tails[0] if tails else None
    if found is None:
        raise FileNotFoundError(
            f"no completed train run with id, short id or experiment {run!r} in {results_dir / 'runs'}"
        )
    return found


def eval_config(run: str, overrides: Iterable[str] = ()) -> tuple[DictConfig, dict[str, Any]]:
    """The run's config with ``overrides``, its results folder this machine's; and its ledger record."""
    from vitexp.config.composition import compose, with_moved_targets
    from vitexp.config.schema import check_types

    results_dir = default_results_dir()
    record = find_run(run, results_dir)
    cfg = OmegaConf.create(with_moved_targets(record["config"]))
    for key in PATH_KEYS:  # stored relative to the project root or the results folder when inside one
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if (
            isinstance(value, str)
            and value != "???"
            and not value.startswith((RUN_WEIGHTS_PREFIX, WEIGHTS_PREFIX))
            and not Path(value).expanduser().is_absolute()
        ):
            OmegaConf.update(cfg, key, str(local_path(value, results_dir)), merge=False)
    with open_dict(cfg):
        if "compile" not in cfg:  # recorded before the compile block: compiled off, overridable
            cfg.compile = compose([]).compile
        cfg.results_dir = str(results_dir)
        cfg.name = record["experiment"]
        cfg.output_dir = str(results_dir / "eval" / record["run_id"])
        cfg.resume = False
    OmegaConf.set_struct(cfg, True)
    for ov in overrides:
        key, _, value = ov.partition("=")
        if key in SWAPPABLE_GROUPS:
            with open_dict(cfg):
                cfg[key] = compose([ov])[key]
            continue
        if OmegaConf.select(cfg, key, default="<missing>") == "<missing>":
            group = key.split(".")[0]
            valid = (
                sorted(cfg[group].keys()) if isinstance(cfg.get(group), DictConfig) else sorted(cfg.keys())
            )
            raise ConfigError(f"{key}: not a key of run {record['run_id']}'s config; valid keys: {valid}")
        OmegaConf.update(cfg, key, OmegaConf.from_dotlist([f"v={value}"]).v, merge=False)
    check_types(cfg)
    return cfg, record


def rebuild_config(cfg: DictConfig, record: dict[str, Any]) -> DictConfig:
    """The config the deployed model is rebuilt from: ``cfg`` without the weights that only start
    the run (``backbone.pretrained``, a teacher's file or ``run:<teacher>`` that may not be on this
    machine; the method's own, :meth:`~vitexp.methods.Method.rebuild_overrides`), whose values the
    run's saved weights replace, and with the data-dependent choices its ledger entry kept. The
    eval's ledger entry records ``cfg`` as given."""
    from vitexp.methods import method_from_config

    built = cfg.copy()
    with open_dict(built):
        built.backbone.pretrained = None
        for key, value in method_from_config(cfg.method).rebuild_overrides(record).items():
            built.method[key] = value
    return built


class Deployed(NamedTuple):
    """A completed run's deployed model rebuilt and loaded (:func:`load_deployed`): its objective, the
    stage it was tested as, the model, the run's datamodules by stage config, and the weights file."""

    objective: Any
    stage: Any
    model: Any
    datamodule_for: Callable[[DictConfig], Any]
    path: Path


class Rebuild(NamedTuple):
    """A completed run's rebuild after the one resolve step (:func:`resolve_rebuild`): the rebuilt
    config's resolved parts, the weights file to load and the name an error gives it."""

    resolved: Any
    path: Path
    key: str


def resolve_rebuild(cfg: DictConfig, record: dict[str, Any], weights: str | None = None) -> Rebuild:
    """The one resolve step of a completed run's rebuild, before its eval run starts: its weights file
    (``weights``, else the run's own, else its W&B artifact's; a missing or unreadable file is a
    :class:`~vitexp.errors.CheckpointError` naming it) and :func:`rebuild_config`'s config resolved."""
    from vitexp.models.factory import check_file
    from vitexp.training.resolve import resolve

    artifacts = record.get("artifacts") or {}
    key = "--weights" if weights else f"run {record['run_id']}'s weights"
    if weights:  # the file given, checked first: no fallback to the run's own
        check_file(Path(weights).expanduser(), key)
    path = (
        Path(weights).expanduser()
        if weights
        else (weights_file(record, cfg.results_dir) or local_path(artifacts.get("weights"), cfg.results_dir))
    )
    if (
        not weights and (path is None or not path.is_file()) and artifacts.get("wandb_model")
    ):  # trained elsewhere
        fetched = fetch_model(artifacts["wandb_model"], Path(cfg.results_dir) / ARTIFACTS_SUBDIR)
        path = Path(fetched["artifacts"]["weights"])
    if path is None or not path.is_file():
        raise CheckpointError(
            f"{key}: {path} is not on this machine; pass --weights (weights.pth or "
            "checkpoints/last.ckpt of that run) or rerun it"
        )
    check_file(path, key)
    return Rebuild(resolve(rebuild_config(cfg, record)), path, key)


def load_deployed(rebuild: Rebuild, cfg: DictConfig, record: dict[str, Any]) -> Deployed:
    """The run's deployed model rebuilt from its resolved parts (:func:`resolve_rebuild`) and loaded
    with their weights file; a file that does not fit is a :class:`~vitexp.errors.CheckpointError`
    naming it (module docstring). Writes nothing."""
    import lightning as L

    from vitexp.training.build import build_backbone_and_method, load_weights
    from vitexp.training.fit import datamodule_cache

    resolved, path, key = rebuild
    built, objective = resolved.cfg, resolved.objective
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    backbone, method, data_config = build_backbone_and_method(built, resolved.method, resolved.weights)
    datamodule_for = datamodule_cache(data_config)
    method.prepare(backbone, datamodule_for(cfg))
    # the run's config, not ``built``: the objective's model follows the run's choices (backbone.pretrained
    # too)
    stage, model = objective.rebuild(cfg, method, backbone, record, data_config)
    try:
        model.load_state_dict(load_weights(path))
    except (RuntimeError, KeyError) as err:  # keys or shapes of another model: before the ledger entry
        raise CheckpointError(
            f"{key}: {path} does not fit the model of run {record['run_id']} ({join_lines(str(err))[:300]})"
        ) from None
    return Deployed(objective, stage, model, datamodule_for, path)


def evaluate(cfg: DictConfig, record: dict[str, Any], weights: str | None = None) -> dict[str, Any]:
    """Rebuild, load and test (module docstring); returns the closing result of the eval run."""
    from vitexp.config.composition import to_container
    from vitexp.runs.owner import owned_run
    from vitexp.training.build import build_trainer
    from vitexp.training.fit import compile_protocol, stage_config

    rebuild = resolve_rebuild(cfg, record, weights)
    with owned_run(cfg.name, "eval", cfg.results_dir, cfg.output_dir, cfg.logger, job_type="eval") as run:
        objective, stage, model, datamodule_for, path = load_deployed(rebuild, cfg, record)
        run.start({**to_container(cfg), "evaluates": record["run_id"]})
        scfg = stage_config(cfg, stage)
        trainer = build_trainer(scfg, False, Path(cfg.output_dir), test_only=True)
        metrics = objective.test(
            trainer, objective.module(scfg, stage, model), datamodule_for(scfg), stage.metrics_prefix or ""
        )
        ran = record.get("metrics") or {}
        print(
            f"{cfg.name}: "
            + ", ".join(
                f"{k} {metrics[k]:.2f} % (run {record['run_id']}: {ran.get(k)})" for k in objective.headline
            )
        )
        run.complete(
            metrics,
            {"accuracy_unit": "%", "weights": portable_path(path, cfg.results_dir), **compile_protocol(cfg)},
            out={"evaluates": record["run_id"]},
            evaluates=record["run_id"],
        )
    return run.result
