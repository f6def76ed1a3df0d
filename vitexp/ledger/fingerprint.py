"""The fingerprint of a run's configuration: what a table row matches runs by.

Its reasoning: docs/ledger.md, "vitexp/ledger/fingerprint.py".
"""

from __future__ import annotations

import copy
import hashlib
import json
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping

from vitexp.ledger.schema import RUN_GROUPS

VERSION = "v3"  # v3: bspf_spec and the groups of another objective left out, moved keys read where they lie
RUN_PREFIX = "run:"
#: Config keys (dotted; ``*.key`` at any depth) that do not change what a run measures.
EXCLUDED = (
    "name",
    "resume",
    "output_dir",
    "results_dir",
    "evaluates",
    "hydra",
    "logger",
    "data.root",
    "data.num_workers",
    "data.package",
    "trainer.accelerator",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
    "eval.flops",
    "eval.throughput",
    "eval.throughput_batch",
    "eval.throughput_iters",
    "trainer.num_sanity_val_steps",
    "compile",  # torch.compile: the speed, not what is measured (docs/measurements.md, "Compiled")
    "bench",
    "*._target_",
)
#: Keys read only through interpolations in other keys, which the config records resolved.
INTERPOLATED = ("bspf_spec", "backbone.bspf")
#: Keys that moved: {old dotted key: (today's dotted key, {old value: today's value} or ``None``: the
#: value as it was)}. An old key that is a mapping moves with everything under it.
MOVED: dict[str, tuple[str, dict[Any, Any] | None]] = {
    "method.freeze_backbone": ("method.trainable", {True: "scores", False: "all"}),  # SAPER's trainable parts
}
#: Returned by a ``default_of`` for a key that has no default in a group file.
NO_DEFAULT = object()


@lru_cache(maxsize=None)
def _compiled(exclusions: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """(dotted keys, ``*.`` leaf names) of ``exclusions``."""
    return (
        frozenset(e for e in exclusions if not e.startswith("*.")),
        frozenset(e[2:] for e in exclusions if e.startswith("*.")),
    )


def excluded(key: str, exclusions: Iterable[str] = EXCLUDED) -> bool:
    """Whether the dotted config key ``key`` (or a group it lies in) is one of ``exclusions``."""
    keys, leaves_ = _compiled(tuple(exclusions))
    parts = key.split(".")
    if parts[-1] in leaves_:
        return True
    return any(".".join(parts[:i]) in keys for i in range(1, len(parts) + 1))


def strip(
    config: Mapping[str, Any], exclusions: Iterable[str] = EXCLUDED, prefix: str = ""
) -> dict[str, Any]:
    """``config`` without the keys in ``exclusions`` (at any depth)."""
    keys, leaves_ = _compiled(tuple(exclusions))

    def walk(node: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out = {}
        for k, v in node.items():
            key = f"{prefix}{k}"
            if key in keys or k in leaves_:
                continue
            out[k] = walk(v, key + ".") if isinstance(v, Mapping) else v
        return out

    return walk(config, prefix)


def _pop(config: dict[str, Any], key: str) -> Any:
    node = config
    *path, leaf = key.split(".")
    for part in path:
        node = node.get(part)
        if not isinstance(node, dict):
            return NO_DEFAULT
    return node.pop(leaf, NO_DEFAULT)


def _put(config: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` unless it is there already (a run recorded after the move keeps its own)."""
    node = config
    *path, leaf = key.split(".")
    for part in path:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            return
        node = nxt
    if leaf not in node:
        node[leaf] = value


def moved(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every key of :data:`MOVED` where it lies today (a copy when one moved)."""
    if not any(_has(config, old) for old in MOVED):
        return dict(config)
    out = copy.deepcopy(dict(config))
    for old, (new, values) in MOVED.items():
        value = _pop(out, old)
        if value is NO_DEFAULT:
            continue
        if values is not None:
            value = (
                values.get(value, value) if isinstance(value, (str, int, float, bool, type(None))) else value
            )
        _put(out, new, value)
    return out


def _has(config: Mapping[str, Any], key: str) -> bool:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


#: {config group: the ``objective`` choice that alone reads it}: a run of another objective leaves
#: the group out of its fingerprint (the group's schema:
#: :data:`vitexp.config.objective_schemas.OBJECTIVE_SCHEMAS`).
GROUP_OWNERS: dict[str, str] = {"detector": "detect"}


def normalised(
    config: Mapping[str, Any],
    exclusions: Iterable[str] = EXCLUDED,
    experiment_of: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """``config`` with moved keys where they lie today (:data:`MOVED`), without ``exclusions``, the
    keys of :data:`INTERPOLATED` and the groups of another objective (:data:`GROUP_OWNERS`), a
    pinned ``backbone.pretrained: run:<run_id>`` read as ``run:<experiment>`` (what :func:`digest` hashes)."""
    objective = str(config.get("objective") or "auto")
    others = (g for g, o in GROUP_OWNERS.items() if o != objective)
    kept = strip(moved(config), (*exclusions, *INTERPOLATED, *others))
    backbone = kept.get("backbone")
    ref = str((backbone or {}).get("pretrained") or "") if isinstance(backbone, Mapping) else ""
    if ref.startswith(RUN_PREFIX) and experiment_of is not None:
        kept["backbone"] = {**backbone, "pretrained": RUN_PREFIX + experiment_of(ref[len(RUN_PREFIX) :])}
    return kept


#: Kinds whose measurement does not depend on the weights (a FLOPs count, a timing): their runs are
#: cells of a row whatever ``backbone.pretrained`` they had (a row that trains from ``weights:<tag>``
#: is counted and timed without the file), and whatever says only how the model would be trained:
#: the ``recipe`` and the recipe a method carries for the probes it trains (``method.probe``). Every
#: key that builds the model (the backbone, the method, the budget, the data's resolution and classes,
#: the groups of its objective) still separates them.
WEIGHTLESS_KINDS = ("flops", "bench")
WEIGHTLESS_EXCLUDED = (*EXCLUDED, "backbone.pretrained", "recipe", "method.probe")


def _lapsum_folded(recorded: Mapping[str, Any]) -> bool:
    """``method.fold_gates`` of a SAPER run recorded before it: LapSum deployed its final gates folded
    into the projection; a fixed rule has no gates, so nothing was folded (it keeps its row)."""
    return recorded.get("method.selection", "lapsum") == "lapsum"


#: Options added with a default that is NOT what runs before them did: {dotted key: (the choices of
#: its group it applies to (the ``name`` of ``method`` or ``data``), the value a run without the key
#: had, or a function of the run's recorded leaves that gives it)}. A training run recorded without such a key
#: is read as having had that value
#: (:func:`differences`), so that, e.g., SAPER's one-stage runs (before ``method.recover_epochs``: no
#: recovery) never fill a two-stage row, nor its LapSum runs that folded their gates a row of today's
#: unfolded start, nor a run that read its JPEGs with PIL (before ``data.decoder``) a row of today's
#: tensor decoder. Every other key a run lacks is read at its group file's default.
CHANGED_DEFAULTS: dict[str, tuple[tuple[str, ...], Any]] = {
    "method.recover_epochs": (("saper_ft", "saper_kd"), 0),
    "method.straight_through": (("saper_ft", "saper_kd"), False),
    "method.fold_gates": (("saper_ft", "saper_kd"), _lapsum_folded),
    "data.decoder": (("imagenet", "imagefolder"), "pil"),
}


def _choice(config: Mapping[str, Any], key: str) -> str | None:
    """The ``name`` of the group ``key`` lies in (``method.x``: the method's)."""
    group = config.get(key.split(".", 1)[0])
    return group.get("name") if isinstance(group, Mapping) else None


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def flattened(
    config: Mapping[str, Any], weightless: bool = False, experiment_of: Callable[[str], str] | None = None
) -> dict[str, str]:
    """{dotted key: its value as JSON} of :func:`normalised` ``config`` (what :func:`differences`
    compares)."""
    exclusions = WEIGHTLESS_EXCLUDED if weightless else EXCLUDED
    return {k: _text(v) for k, v in leaves(normalised(config, exclusions, experiment_of)).items()}


def differences(
    recorded: Mapping[str, Any],
    today: Mapping[str, Any],
    experiment_of: Callable[[str], str] | None = None,
    weightless: bool = False,
    default_of: Callable[[str], Any] | None = None,
    today_flat: dict[str, str] | None = None,
) -> list[str]:
    """The dotted keys that separate a run's ``recorded`` config from ``today``'s composition of its
    row: a leaf the run has with another value, or one that today's config lacks; and a leaf only
    today's config has (an option added since the run) whose value is not the one such a run had:
    for a training run, :data:`CHANGED_DEFAULTS`' value; else ``default_of(key)``, the key's default
    in its group file (:data:`NO_DEFAULT`, or no ``default_of``: the key separates the run).
    ``weightless``: a FLOPs count or a timing (:data:`WEIGHTLESS_KINDS`): its weights do not
    separate it, nor how it would have trained (:data:`CHANGED_DEFAULTS`). ``today_flat``:
    :func:`flattened` ``today``, when the caller compares many runs with it."""
    old = flattened(recorded, weightless, experiment_of)
    new = today_flat if today_flat is not None else flattened(today, weightless, experiment_of)
    out = {k for k, v in old.items() if new.get(k) != v}
    groups = moved(recorded)
    for key in new.keys() - old.keys():
        choices, was = CHANGED_DEFAULTS.get(key, ((), NO_DEFAULT))
        if weightless or _choice(groups, key) not in choices:
            was = default_of(key) if default_of is not None else NO_DEFAULT
        if callable(was):
            was = was(leaves(recorded))
        if was is NO_DEFAULT or _text(was) != new[key]:
            out.add(key)
    return sorted(out)


def digest(
    config: Mapping[str, Any],
    exclusions: Iterable[str] = EXCLUDED,
    experiment_of: Callable[[str], str] | None = None,
) -> str:
    """A 16-hex-digit hash of ``config`` without ``exclusions``, a pinned ``backbone.pretrained:
    run:<run_id>`` read as the experiment ``experiment_of`` names for that id."""
    kept = normalised(config, exclusions, experiment_of)
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(config: Mapping[str, Any], experiment_of: Callable[[str], str] | None = None) -> str:
    """The versioned fingerprint a ledger entry stores (``v3:<hash>``, :data:`VERSION`)."""
    return f"{VERSION}:{digest(config, EXCLUDED, experiment_of)}"


def weightless(config: Mapping[str, Any]) -> str:
    """The hash of ``config`` without ``backbone.pretrained`` (:data:`WEIGHTLESS_KINDS`)."""
    return digest(config, WEIGHTLESS_EXCLUDED)


# RUN_GROUPS (vitexp.ledger.schema): the groups a composed vitexp config has; a config without them (an
# audit's arguments) gets no fingerprint, and its runs are matched by name.


def is_run_config(config: Any) -> bool:
    """Whether ``config`` is a composed run config (:data:`RUN_GROUPS`)."""
    return isinstance(config, Mapping) and all(isinstance(config.get(g), Mapping) for g in RUN_GROUPS)


def of_config(
    config: Mapping[str, Any] | None, experiment_of: Callable[[str], str] | None = None
) -> str | None:
    """:func:`fingerprint` of a composed run config; ``None`` for anything else (:data:`RUN_GROUPS`)."""
    if not is_run_config(config):
        return None
    return fingerprint(config, experiment_of)


def of_record(record: Mapping[str, Any], experiment_of: Callable[[str], str] | None = None) -> str | None:
    """The entry's fingerprint: as stored when of this :data:`VERSION`; else (another version, or
    none: an entry written before fingerprints, a W&B run) computed from its recorded config;
    ``None`` for an entry whose config is not a run's (:func:`of_config`)."""
    stored = record.get("fingerprint")
    if stored and str(stored).startswith(VERSION + ":"):
        return str(stored)
    return of_config(record.get("config"), experiment_of)


def leaves(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of every leaf of ``config``."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping) and v:
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
