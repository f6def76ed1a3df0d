"""Config composition helpers and validation.

Its reasoning: docs/commands.md, "vitexp/config/composition.py".
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from vitexp import CONF_DIR, PROJECT_ROOT
from vitexp.config.objective_schemas import OBJECTIVE_SCHEMAS
from vitexp.errors import ConfigError, one_line

if not OmegaConf.has_resolver("vitexp_root"):
    OmegaConf.register_new_resolver("vitexp_root", lambda: str(PROJECT_ROOT))


def _job_value(key: str, root: Any) -> Any:
    """The job config's ``key`` as seen from the ``hydra`` node: from the config being resolved
    (``root``), else from the full config that is the parent of ``HydraConfig.get()``, for
    ``--cfg hydra --resolve``, where Hydra resolves the ``hydra`` node alone, without the job's keys."""
    from hydra.core.hydra_config import HydraConfig

    missing = object()
    value = OmegaConf.select(root, key, default=missing)
    if value is missing and HydraConfig.initialized():
        value = OmegaConf.select(HydraConfig.get(), ".." + key, default=missing)
    if value is missing:
        raise ConfigError(f"{key}: not in the composed config")
    return value


def _hydra_run_name(*, _root_: Any) -> str:
    """``${vitexp_name:}``: the run's name (:func:`run_name` of the config's ``name``) inside a
    Hydra app, for its run folder and SLURM job name (``/`` made ``_``); ``name`` as given outside one."""
    from hydra.core.hydra_config import HydraConfig

    name = _job_value("name", _root_)
    if not HydraConfig.initialized():
        return str(name)
    hc = HydraConfig.get()
    choices = {k: v for k, v in hc.runtime.choices.items() if v is not None}
    from vitexp.ledger.entry import short_name

    name = run_name(OmegaConf.create({"name": str(name)}), choices, task_overrides(hc))
    folder = short_name(name.replace("/", "_"), limit=120, keep="-_+=.,[]")
    if folder.strip(".") == "":
        from vitexp.errors import ConfigError

        raise ConfigError(
            f"name={name!r}: the run folder outputs/{folder}/ would not be a folder of its own inside "
            "outputs/ (a name of dots only); give the run a name"
        )
    return folder


def task_overrides(hydra_cfg: Any) -> list[str]:
    """The command line's overrides, each resolved as Hydra's node holds them, or as typed where it
    does not resolve (``recipe.lr=${nope}``): the run folder's name does not fail on it (an error
    naming ``hydra.run.dir``), and :func:`vitexp.config.schema.check_types` names the key."""
    task = hydra_cfg.overrides.task
    out = []
    for i, typed in enumerate(OmegaConf.to_container(task, resolve=False)):
        try:
            out.append(str(task[i]))
        except Exception:  # noqa: BLE001 - check_types names the key
            out.append(str(typed))
    return out


if not OmegaConf.has_resolver("vitexp_name"):
    OmegaConf.register_new_resolver("vitexp_name", _hydra_run_name)
_STAMP: list[str] = []


def run_stamp() -> str:
    """The last part of a run's default folder (``hydra.run.dir``): ``slurm-<job id>`` inside a SLURM
    job, the same for every task of the job and for the job after a requeue (which runs the same
    command and must find the same folder: :mod:`vitexp.runs.slurm`); elsewhere the process's start time
    to the second and six random hex digits, so two runs started in the same second never share a folder
    (fixed once per process)."""
    from vitexp.runs import slurm

    if not _STAMP:
        job = slurm.job_id()
        stamp = f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{secrets.token_hex(3)}"
        _STAMP.append(f"slurm-{job}" if job else stamp)
    return _STAMP[0]


if not OmegaConf.has_resolver("vitexp_stamp"):
    OmegaConf.register_new_resolver("vitexp_stamp", run_stamp)
if not OmegaConf.has_resolver("vitexp_job"):  # ${vitexp_job:trainer.num_nodes} in the hydra node
    OmegaConf.register_new_resolver("vitexp_job", lambda key, *, _root_: _job_value(key, _root_))


def _slurm_resources(trainer: Any) -> dict[str, Any]:
    from vitexp.runs import slurm

    return slurm.resources(trainer)


if not OmegaConf.has_resolver(
    "vitexp_slurm"
):  # ${vitexp_slurm:gpus_per_node}: a job's resources by its trainer
    OmegaConf.register_new_resolver(
        "vitexp_slurm", lambda key, *, _root_: _slurm_resources(_job_value("trainer", _root_))[key]
    )

#: Groups whose choice defines what a run is (a change renames the run).
IDENTITY_GROUPS = ("backbone", "method", "budget", "data", "recipe")
#: Groups whose keys are vitexp's schema, the objectives' own among them: ``+group.key=...`` may not
#: add to them. (``trainer`` keys are lightning.Trainer arguments: ``+trainer.accumulate_grad_batches=2`` adds
#: one.)
SCHEMA_GROUPS = (
    "backbone",
    "method",
    "budget",
    "data",
    "recipe",
    "logger",
    "eval",
    "bench",
    "bspf_spec",
    *OBJECTIVE_SCHEMAS,
)


def compose(
    overrides: Iterable[str] = (), config_name: str = "train", return_hydra_config: bool = False
) -> DictConfig:
    """Compose the real config tree (as tests and tools do), without Hydra's runtime; every key
    checked against its type (:func:`vitexp.config.schema.check_types`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from vitexp.config.schema import check_types

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(
            config_name=config_name, overrides=list(overrides), return_hydra_config=return_hydra_config
        )
    check_types(cfg)
    return cfg


#: Keys ``++`` may add to a group that lacks them: the W&B grouping vitexp-sweep gives every job,
#: whatever its logger (``csv`` and ``none`` have no such keys), and ``backbone.use_ema``, which no
#: backbone file writes (absent: the reference evaluation's set; :mod:`vitexp.models.factory` says why).
ADDABLE_KEYS = ("logger.group", "logger.tags", "backbone.use_ema")


def _compose_beside_hydra(overrides: list[str]) -> DictConfig:
    """:func:`compose` from inside a running Hydra app, whose global state is restored after."""
    from hydra.core.global_hydra import GlobalHydra

    running = GlobalHydra.instance().hydra
    try:
        return compose(overrides)
    finally:
        GlobalHydra.instance().clear()
        if running is not None:
            GlobalHydra.instance().initialize(running)


def top_level_keys() -> set[str]:
    """The config's top-level keys (:class:`vitexp.config.schema.Config`'s, ``method``, ``trainer``)."""
    from vitexp.config.schema import Config, _hints

    return set(_hints(Config)) | {"method", "trainer", "hydra"}


def check_overrides(cfg: DictConfig, overrides: Iterable[str]) -> None:
    """Refuse ``+group.key=value``, and ``++group.key=value`` where the key did not exist, that adds
    a key to one of :data:`SCHEMA_GROUPS` (a misspelt key would otherwise be accepted and ignored),
    naming the valid keys where it was added; and ``~group.key``, which removes a key the code
    reads. A mapping whose keys the schema leaves free (``backbone.kwargs``: timm's arguments) takes
    added keys (:func:`vitexp.config.schema.takes_any_key`)."""
    from vitexp.config.schema import takes_any_key

    overrides = list(overrides)
    for ov in overrides:
        removed = ov.lstrip("~").split("=", 1)[0]
        if ov.startswith("~") and removed.partition(".")[0] in SCHEMA_GROUPS and "." in removed:
            raise ConfigError(
                f"{removed}: a key of {removed.partition('.')[0]} cannot be removed ('{ov}'); "
                f"set its value instead ({removed}=...)"
            )
        if not ov.startswith("+"):
            continue
        key = ov.lstrip("+").split("=", 1)[0]
        group, _, sub = key.partition(".")
        if not sub and "/" not in key and key not in top_level_keys() and not (CONF_DIR / key).is_dir():
            valid = sorted(k for k in cfg.keys() if k not in ("hydra", key))  # +foo=1: a key nothing reads
            raise ConfigError(
                f"{key}: not a key of the config (added with '{ov[: len(ov) - len(ov.lstrip('+'))]}'); "
                f"its keys: {valid}"
            )
        if group not in SCHEMA_GROUPS or not sub:
            continue
        parent_key, _, leaf = key.rpartition(".")
        if takes_any_key(parent_key):  # a mapping of free keys (backbone.kwargs): adding is what it is for
            continue
        if ov.startswith("++"):  # add-or-override: refused only when it adds
            if key in ADDABLE_KEYS:
                continue
            without = _compose_beside_hydra([o for o in overrides if o != ov])
            parent = OmegaConf.select(without, parent_key, default=None, throw_on_resolution_failure=False)
            if (
                isinstance(parent, DictConfig) and leaf in parent.keys()
            ):  # an existing key (even ???): overridden
                continue
        else:
            parent = OmegaConf.select(cfg, parent_key, default=None)
        valid = sorted(k for k in parent.keys() if k != leaf) if isinstance(parent, DictConfig) else []
        raise ConfigError(
            f"{key}: not a key of {parent_key} (added with '{ov[: len(ov) - len(ov.lstrip('+'))]}'); "
            f"valid keys: {valid}"
        )


def composition_error(err: BaseException, prog: str) -> str:
    """Hydra's composition error in one line (:func:`vitexp.errors.one_line`). An unknown key
    names its group's keys and how to see every key, instead of Hydra's ``+group.key=...``, which
    :func:`check_overrides` refuses for vitexp's groups."""
    cause = err.__cause__
    key = getattr(cause, "full_key", None)
    if not key or "not in struct" not in str(cause):
        return one_line(err)
    parent_key = key.rpartition(".")[0]
    parent = getattr(cause, "parent_node", None)
    keys = sorted(k for k in parent.keys() if k != "hydra") if isinstance(parent, DictConfig) else []
    trainer = " (+trainer.<arg>=... adds a lightning.Trainer argument)" if parent_key == "trainer" else ""
    if key in ADDABLE_KEYS:
        trainer = f" ({key} is added with ++{key}=...)"
    return (
        f"{key}: not a key of {parent_key or 'the config'}; its keys: {keys}; "
        f"`{prog} --cfg job` prints every key with its value{trainer}"
    )


def group_choices(cfg: DictConfig | None = None) -> dict[str, str]:
    """Hydra's group choices of the running app (empty outside a Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return {k: v for k, v in HydraConfig.get().runtime.choices.items() if v is not None}
    return {}


def run_name(cfg: DictConfig, choices: dict[str, str], overrides: Iterable[str]) -> str:
    """The name a run is recorded under: its experiment's name, or, when the command line changed
    anything that changes what the run measures (a group choice other than the experiment file's,
    or any key but those :data:`vitexp.ledger.fingerprint.EXCLUDED` lists: logging, paths, the
    accelerator, the progress bar), ``"<experiment>+<override>,..."``, so a ledger name never claims
    an experiment it did not run (``demo+trainer.limit_train_batches=1``). An explicit ``name=``
    is kept as given."""
    from vitexp.ledger.fingerprint import excluded

    experiment = choices.get("experiment")
    overrides = list(overrides)
    if not experiment or any(ov.split("=", 1)[0].lstrip("+~") == "name" for ov in overrides):
        return str(cfg.name)
    pinned_choices = experiment_choices(experiment)
    changes = []
    for group in IDENTITY_GROUPS:
        if group in choices and pinned_choices.get(group, choices[group]) != choices[group]:
            changes.append(f"{group}={choices[group]}")
    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("+~")
        if "/" in key or key in IDENTITY_GROUPS or key == "experiment" or excluded(key):
            continue
        if "." not in key and key in choices and pinned_choices.get(key) == choices[key]:
            continue  # the experiment file's own choice (experiment=deit_small_baseline trainer=ddp)
        changes.append(ov.lstrip("+~"))
    return str(cfg.name) + ("+" + ",".join(changes) if changes else "")


def experiment_choices(experiment: str) -> dict[str, str]:
    """Group choices an experiment composes: train.yaml's defaults, updated by the experiment
    file's ``override /group: choice`` entries."""
    pins: dict[str, str] = {}
    for file, prefix in (
        (CONF_DIR / "train.yaml", ""),
        (CONF_DIR / "experiment" / f"{experiment}.yaml", "override /"),
    ):
        if not file.is_file():
            continue
        defaults = OmegaConf.to_container(OmegaConf.load(file), resolve=False).get(
            "defaults", []
        )  # ${backbone} stays
        for entry in defaults or []:
            if isinstance(entry, dict):
                for k, v in entry.items():
                    if str(k).startswith(prefix) and v is not None:
                        pins[str(k)[len(prefix) :]] = str(v)
    return pins


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python (for the ledger and W&B); Hydra's node is dropped."""
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    container.pop("hydra", None)
    return container


#: Class paths a recorded config may name from before the package layout (docs/layout.md): old prefix ->
#: today's. ``vitexp.data.<Class>`` was the datamodules' module, now ``vitexp.data.datamodules``.
MOVED_TARGETS = {
    "vitexp.fashion_mnist.": "vitexp.data.fashion_mnist.",
    "vitexp.data.": "vitexp.data.datamodules.",
}


def moved_target(target: str) -> str:
    """``target`` (a ``_target_`` class path) where the class lies today (:data:`MOVED_TARGETS`)."""
    for old, new in MOVED_TARGETS.items():
        rest = target[len(old) :]
        if target.startswith(old) and rest and "." not in rest:
            return new + rest
    return target


def with_moved_targets(config: Any) -> Any:
    """A recorded config (plain dict) with every ``_target_`` where its class lies today."""
    if isinstance(config, dict):
        return {
            k: moved_target(v) if k == "_target_" and isinstance(v, str) else with_moved_targets(v)
            for k, v in config.items()
        }
    if isinstance(config, list):
        return [with_moved_targets(v) for v in config]
    return config
