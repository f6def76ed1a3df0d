"""Typed schemas of the config groups, checked when a config is composed.

Its reasoning: docs/commands.md, "vitexp/config/schema.py".
"""

from __future__ import annotations

import collections.abc as cabc
import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from vitexp.config.objective_schemas import OBJECTIVE_SCHEMAS
from vitexp.config.value_types import _is_union, _number, conforms, describe  # noqa: F401 (re-exported)
from vitexp.errors import ConfigError


@dataclass
class Arch:
    """``backbone.arch``: the architecture facts budgets are validated against."""

    depth: int
    num_heads: int
    embed_dim: int
    patch_size: int
    num_prefix_tokens: int
    family: Optional[str]


@dataclass
class Backbone:
    name: str
    timm_name: str
    img_size: int
    img_size_kwarg: bool
    crop_pct: Optional[float]
    pretrained: Optional[str]
    use_ema: Optional[
        bool
    ]  # not in the backbone files (vitexp.models.factory): absent, the reference evaluation's set
    drop_path_rate: Optional[float]
    kwargs: Dict[str, Any]
    arch: Arch


@dataclass
class Data:
    _target_: str
    name: str
    root: Optional[str]
    package: Optional[str]
    num_classes: int
    batch_size: int
    num_workers: int
    split: List[float]
    split_seed: int
    val_fraction: float
    val_size: int
    train_dir: str
    val_dir: str
    test_dir: Optional[str]
    augment: bool
    auto_augment: Optional[str]
    random_erase: float
    decoder: str
    hflip: float
    translate: int
    generate: Optional[Dict[str, Any]]
    num_train: int
    num_val: int
    num_test: int
    noise: float
    seed: int


@dataclass
class Recipe:
    name: str
    epochs: int
    batch_size: int
    opt: str
    lr: float
    lr_base_batch: Optional[int]
    weight_decay: float
    momentum: Optional[float]
    sched: str
    warmup_epochs: float
    warmup_steps: Optional[int]  # null: no step warm-up (vitexp.training.modules reads it so)
    warmup_lr: float
    min_lr: float
    decay_epochs: List[float]
    decay_rate: float
    label_smoothing: float
    mixup: float
    cutmix: float
    auto_augment: Optional[str]
    random_erase: float
    drop_path: float
    grad_clip: Optional[float]


@dataclass
class Budget:
    kind: str
    keep_ratio: float
    k: int
    r: Union[int, List[int]]


@dataclass
class Logger:
    kind: str
    project: str
    entity: Optional[str]
    mode: Optional[str]
    tags: List[str]
    group: Optional[str]
    init_timeout: float


@dataclass
class BspfSpec:
    chunk_size: Optional[int]
    prune_layers: List[int]


@dataclass
class Eval:
    flops: bool
    throughput: bool
    throughput_batch: Optional[int]
    throughput_iters: int


@dataclass
class Compile:
    enabled: bool
    mode: str
    fullgraph: bool
    backend: str


@dataclass
class BenchLoader:
    root: Optional[str]
    split: str
    decoders: List[str]
    workers: int
    batches: int
    train_per_class: int
    val_per_class: int


@dataclass
class Bench:
    mode: str
    device: str
    amp: Optional[bool]
    batch_size: Optional[int]
    rounds: int
    iters: int
    warmup: int
    steps: int
    demo_args: List[str]
    compare: List[str]
    loader: BenchLoader


@dataclass
class Config:
    """``conf/train.yaml`` composed; ``method`` and ``trainer`` are typed by their constructors, the
    objectives' own groups by their plug-ins (:func:`_hints`)."""

    name: str
    seed: int
    objective: str
    resume: Union[bool, str]
    output_dir: str
    results_dir: str
    eval: Eval
    compile: Compile
    bench: Bench
    backbone: Backbone
    bspf_spec: BspfSpec
    data: Data
    recipe: Recipe
    budget: Budget
    logger: Logger


def recipe_keys(name: str, keys: Any) -> type:
    """A ``TypedDict`` of the ``Recipe`` keys ``keys`` (each optional), for a method argument that
    holds recipe keys of its own stages (RAPTOR's ``method.probe``): :func:`check_types` checks its
    values as the recipe's and refuses any other key."""
    hints = _hints(Recipe)
    return typing.TypedDict(name, {k: hints[k] for k in sorted(keys)}, total=False)


def _typed_dict(annotation: Any) -> type | None:
    """The ``TypedDict`` of ``annotation`` (``Optional`` unwrapped), else None."""
    members = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    return next((a for a in members if typing.is_typeddict(a)), None)


#: ``lightning.Trainer`` arguments vitexp sets itself, and the key that says what to set instead.
TRAINER_SET_BY_VITEXP = {
    "max_epochs": "recipe.epochs",
    "gradient_clip_val": "recipe.grad_clip",
    "default_root_dir": "hydra.run.dir",
    "logger": "logger=wandb|csv|none",
    "callbacks": None,
    "plugins": None,
    "enable_checkpointing": None,
}  # vitexp's ModelCheckpoint: last.ckpt, which resume reads

_SKIP = object()  # ??? or an interpolation that does not resolve: validate's to name


def check_types(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for the first key whose value does not have its schema's type
    (module docstring). The ``hydra`` node is not checked."""
    values = _plain(cfg)
    if not isinstance(values, dict):
        return
    values.pop("hydra", None)
    method, trainer = values.pop("method", None), values.pop("trainer", None)
    converted: dict[str, Any] = {}
    _check_mapping(values, _hints(Config), "", owner=None, converted=converted)
    if isinstance(method, dict):
        target = method.get("_target_")
        if isinstance(target, str):
            params, open_ = _constructor_hints(target, "method._target_")
            _check_mapping(
                {k: v for k, v in method.items() if not k.startswith("_")},
                params,
                "method.",
                owner=None if open_ else target,
                converted=converted,
            )
    if isinstance(trainer, dict):
        for key, instead in TRAINER_SET_BY_VITEXP.items():
            if key in trainer:
                raise ConfigError(f"trainer.{key}: set by vitexp" + (f" (set {instead})" if instead else ""))
        params, open_ = _constructor_hints("lightning.Trainer", "trainer")
        params = {k: v for k, v in params.items() if k not in TRAINER_SET_BY_VITEXP}
        _check_mapping(
            trainer, params, "trainer.", owner=None if open_ else "lightning.Trainer", converted=converted
        )
    if converted:  # the numbers, as a structured config would hold them: the code reads numbers
        from omegaconf import open_dict

        with open_dict(cfg):
            for key, value in converted.items():
                OmegaConf.update(cfg, key, value, merge=False)


def takes_any_key(key: str) -> bool:
    """Whether ``key`` (``backbone.kwargs``, ``data.generate``) is a mapping of the schema whose keys
    are free (``Dict[str, ...]``, ``Any``), so ``+backbone.kwargs.init_values=1.0`` may add to it;
    a dataclass group's keys are not (a misspelt key would be ignored)."""
    annotation: Any = Config
    for part in key.split("."):
        if annotation is Any or _is_mapping(annotation) and not dataclasses.is_dataclass(annotation):
            return True  # inside a free mapping: anything below is free too
        if not dataclasses.is_dataclass(annotation):
            return False  # a key the schema does not type (method, trainer), or a scalar
        annotation = _hints(annotation).get(part)
        if annotation is None:
            return False
        if _is_union(annotation):  # Optional[Dict[...]]: the mapping
            annotation = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)
    return annotation is Any or (_is_mapping(annotation) and not dataclasses.is_dataclass(annotation))


def _is_mapping(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (dict, cabc.Mapping) or annotation in (dict, Mapping)


def _plain(node: Any) -> Any:
    """``node`` as plain Python, interpolations resolved, ``???`` and unresolvable values :data:`_SKIP`."""
    if isinstance(node, DictConfig):
        out = {}
        for key in node.keys():
            if OmegaConf.is_missing(node, key) or "${hydra:" in str(node._get_node(key)._value()):
                out[key] = (
                    _SKIP  # ???, or Hydra's own value (None after another compose left HydraConfig set)
                )
                continue
            try:
                out[key] = _plain(node[key])
            except Exception as err:  # noqa: BLE001 - an interpolation that does not resolve
                out[key] = _unresolved(node, key, err)
        return out
    if isinstance(node, ListConfig):
        try:
            return [_plain(v) for v in node]
        except Exception:  # noqa: BLE001
            return _SKIP
    return node


class Unresolved:
    """A key whose interpolation does not resolve (``recipe.lr=${nope}``): :func:`check_types`
    names the key, its value as written and why."""

    def __init__(self, raw: Any, err: BaseException):
        self.raw, self.err = raw, err


def _unresolved(node: DictConfig, key: str, err: BaseException) -> Any:
    """:class:`Unresolved`, or :data:`_SKIP` for what is validate's to name or resolves later: an
    interpolation of a ``???`` key, and ``${hydra:...}`` outside a Hydra app (``compose``)."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        raw = node._get_node(key)._value()
    except Exception:  # noqa: BLE001
        raw = None
    # a missing optional group (bspf_spec/<backbone>.yaml): validate names the file to add
    if isinstance(err, MissingMandatoryValue) or "${hydra:" in str(raw) or "${bspf_spec." in str(raw):
        return _SKIP
    return Unresolved(raw, err)


def _hints(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    if schema is Config:  # the groups the objectives own
        hints.update(OBJECTIVE_SCHEMAS)
    return hints


@functools.lru_cache(maxsize=None)
def _constructor_hints(target: str, key: str) -> tuple[dict[str, Any], bool]:
    """{argument: annotation} of ``target``'s constructor (``Any`` where it has none), and whether
    it takes any keyword (``**kwargs``)."""
    from hydra.utils import get_class

    try:
        cls = get_class(target)
    except Exception as err:  # noqa: BLE001 - a misspelt _target_
        raise ConfigError(f"{key}: cannot import {target!r} ({type(err).__name__})") from None
    init: Callable = cls.__init__
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: that argument is unchecked
        hints = {}
    params = inspect.signature(init).parameters
    named = {
        n: hints.get(n, Any)
        for n, p in params.items()
        if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return named, any(p.kind == p.VAR_KEYWORD for p in params.values())


def _check_mapping(
    values: Mapping[str, Any],
    hints: Mapping[str, Any],
    prefix: str,
    owner: str | None,
    converted: dict[str, Any] | None = None,
) -> None:
    """Check ``values`` against ``hints``; a string that converts losslessly to the number expected
    (``${oc.env:SLURM_ARRAY_TASK_ID}`` is ``'3'``) goes into ``converted`` as that number."""
    converted = {} if converted is None else converted
    for key, value in values.items():
        if value is _SKIP:
            continue
        if isinstance(value, Unresolved):
            from vitexp.errors import one_line

            why = one_line(value.err).split("\n")[0]
            raise ConfigError(
                f"{prefix}{key}: {value.raw} does not resolve ({why.rpartition(': ')[2] or why})"
            )
        if key not in hints:
            if owner is not None:
                raise ConfigError(
                    f"{prefix}{key}: not an argument of {owner}; its arguments: {sorted(hints)}"
                )
            continue  # a key no schema knows: Hydra's struct mode and check_overrides refuse unknown keys
        annotation = hints[key]
        keys = _typed_dict(annotation)
        if keys is not None and isinstance(value, Mapping):
            valid = typing.get_type_hints(keys)
            for sub in value:
                if sub not in valid:
                    raise ConfigError(
                        f"{prefix}{key}.{sub}: not a key of {prefix}{key}; valid keys: {sorted(valid)}"
                    )
            _check_mapping(value, valid, f"{prefix}{key}.", owner=None, converted=converted)
        elif dataclasses.is_dataclass(annotation) and isinstance(value, Mapping):
            _check_mapping(value, _hints(annotation), f"{prefix}{key}.", owner=None, converted=converted)
        elif _contains_skip(value):
            continue
        elif not conforms(value, annotation):
            number = _number(value, annotation)
            if number is None:
                raise ConfigError(f"{prefix}{key}: {value!r} is not {describe(annotation)}")
            converted[f"{prefix}{key}"] = number


def _contains_skip(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_contains_skip(v) for v in value.values())
    if isinstance(value, list):
        return any(_contains_skip(v) for v in value)
    return value is _SKIP
