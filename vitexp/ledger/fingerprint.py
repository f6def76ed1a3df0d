"""The fingerprint of a run's configuration: what a table row matches runs by.

A fingerprint is a short hash of the resolved config without the keys that do not change what a
run measures (:data:`EXCLUDED`, the one list of them: run names (:func:`vitexp.config.run_name`),
fingerprints and table rows all read it). Two runs with one fingerprint trained, counted or timed the
same configuration; a run with any other change (``trainer.limit_train_batches``, another
``backbone.pretrained``, another precision) has another fingerprint.

Decisions:
- Excluded: the run's name and where it writes (``name``, ``output_dir``, ``results_dir``,
  ``resume``, ``evaluates``), how it logs (``logger``), where its data lies and how it is read
  (``data.root``, ``data.num_workers``, ``data.package``), the accelerator and the progress display
  (``trainer.accelerator``, ``trainer.enable_progress_bar``, ``trainer.enable_model_summary``,
  ``trainer.log_every_n_steps``), which costs are measured at the end (``eval.flops``,
  ``eval.throughput`` and their settings ``eval.throughput_*``: they add metrics, they change none;
  ``trainer.num_sanity_val_steps``: a check before training, no step, no draw from the training
  order), how a model is timed (``bench``: a bench entry records its device, batch, precision and
  mode in its ``protocol``, which a table row selects by; a train run never reads it) and the classes' import paths
  (``_target_`` at any depth: a class moved by a refactor is the same method, its group's ``name``
  says which). Kept: the seed, precision, devices, strategy, every ``limit_*_batches`` and every
  key of the identity groups.
- ``backbone.pretrained: run:<run_id>`` (what validation pins ``run:<experiment>`` to) is read as
  ``run:<experiment>``: each run pins the newest run of its start anew, and which one it loaded is
  the table's concern (:meth:`vitexp.ledger.Ledger.start_of`), not the configuration's.
- A ledger entry stores ``fingerprint`` as ``<VERSION>:<hash>``; an entry of another version (or
  none: entries written before fingerprints) is fingerprinted from its recorded config when needed.
- A key that today's config has and a run's recorded config lacks (an option added since, whose
  default is the behaviour the run had) does not separate the run from its row: besides the exact
  hash, :func:`differences` compares the recorded leaves with today's (the ledger's row lookup).
  A key the run has and today's config lacks, or another value, does; so does an option of
  :data:`CHANGED_DEFAULTS` (added with a default that changed what runs do) at another value.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Iterable, Mapping

VERSION = "v2"  # v2: bench, eval.throughput_*, trainer.num_sanity_val_steps excluded
RUN_PREFIX = "run:"
#: Config keys (dotted; ``*.key`` at any depth) that do not change what a run measures.
EXCLUDED = (
    "name", "resume", "output_dir", "results_dir", "evaluates", "hydra", "logger",
    "data.root", "data.num_workers", "data.package",
    "trainer.accelerator", "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.log_every_n_steps",
    "eval.flops", "eval.throughput", "eval.throughput_batch", "eval.throughput_iters", "trainer.num_sanity_val_steps",
    "bench", "*._target_",
)


def excluded(key: str, exclusions: Iterable[str] = EXCLUDED) -> bool:
    """Whether the dotted config key ``key`` (or a group it lies in) is one of ``exclusions``."""
    parts = key.split(".")
    for ex in exclusions:
        if ex.startswith("*."):
            if parts[-1] == ex[2:]:
                return True
        elif key == ex or key.startswith(ex + "."):
            return True
    return False


def strip(config: Mapping[str, Any], exclusions: Iterable[str] = EXCLUDED, prefix: str = "") -> dict[str, Any]:
    """``config`` without the keys in ``exclusions`` (at any depth)."""
    exclusions = tuple(exclusions)
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if excluded(key, exclusions):
            continue
        out[k] = strip(v, exclusions, key + ".") if isinstance(v, Mapping) else v
    return out


def normalised(config: Mapping[str, Any], exclusions: Iterable[str] = EXCLUDED,
               experiment_of: Callable[[str], str] | None = None) -> dict[str, Any]:
    """``config`` without ``exclusions``, a pinned ``backbone.pretrained: run:<run_id>`` read as
    ``run:<experiment>`` (what :func:`digest` hashes)."""
    kept = strip(config, exclusions)
    backbone = kept.get("backbone")
    ref = str((backbone or {}).get("pretrained") or "") if isinstance(backbone, Mapping) else ""
    if ref.startswith(RUN_PREFIX) and experiment_of is not None:
        kept["backbone"] = {**backbone, "pretrained": RUN_PREFIX + experiment_of(ref[len(RUN_PREFIX):])}
    return kept


#: Kinds whose measurement does not depend on the weights (a FLOPs count, a timing): their runs are
#: cells of a row whatever ``backbone.pretrained`` they had (a row that trains from ``weights:<tag>``
#: is counted and timed without the file).
WEIGHTLESS_KINDS = ("flops", "bench")
WEIGHTLESS_EXCLUDED = (*EXCLUDED, "backbone.pretrained")


def _lapsum_folded(recorded: Mapping[str, Any]) -> bool:
    """``method.fold_gates`` of a SAPER run recorded before it: LapSum deployed its final gates folded
    into the projection; a fixed rule has no gates, so nothing was folded (it keeps its row)."""
    return recorded.get("method.selection", "lapsum") == "lapsum"


#: Options added with a default that is NOT what runs before them did: {dotted key: (the methods it
#: applies to, the value a run without the key had, or a function of the run's recorded leaves that
#: gives it)}. A run recorded without such a key is read as having had that value
#: (:func:`differences`, :func:`changed_defaults`), so that, e.g., SAPER's one-stage runs (before
#: ``method.recover_epochs``: no recovery) never fill a two-stage row, nor its LapSum runs that folded
#: their gates a row of today's unfolded start.
CHANGED_DEFAULTS: dict[str, tuple[tuple[str, ...], Any]] = {
    "method.recover_epochs": (("saper_ft", "saper_kd"), 0),
    "method.straight_through": (("saper_ft", "saper_kd"), False),
    "method.fold_gates": (("saper_ft", "saper_kd"), _lapsum_folded),
}


def _method_name(config: Mapping[str, Any]) -> str | None:
    method = config.get("method")
    return method.get("name") if isinstance(method, Mapping) else None


def lacks_changed_default(recorded: Mapping[str, Any]) -> bool:
    """Whether ``recorded`` (a run's config) predates an option of :data:`CHANGED_DEFAULTS` of its method."""
    name, flat = _method_name(recorded), None
    for key, (methods, _) in CHANGED_DEFAULTS.items():
        if name in methods:
            flat = flat if flat is not None else leaves(recorded)
            if key not in flat:
                return True
    return False


def changed_defaults(recorded: Mapping[str, Any], today: Mapping[str, Any]) -> list[str]:
    """The keys of :data:`CHANGED_DEFAULTS` that ``recorded`` lacks and whose value ``today`` is
    another than the one such a run had."""
    name, old, new = _method_name(recorded), leaves(recorded), leaves(today)
    return sorted(k for k, (methods, was) in CHANGED_DEFAULTS.items()
                  if name in methods and k not in old and k in new and new[k] != (was(old) if callable(was) else was))


def differences(recorded: Mapping[str, Any], today: Mapping[str, Any],
                experiment_of: Callable[[str], str] | None = None, weightless: bool = False) -> list[str]:
    """The dotted keys that separate a run's ``recorded`` config from ``today``'s composition of its
    row: a leaf the run has with another value, or one that today's config lacks. A leaf only today's
    config has (an option added since the run) is not a difference (module docstring).
    ``weightless``: a FLOPs count or a timing (:data:`WEIGHTLESS_KINDS`): neither its weights nor how
    it would train (:data:`CHANGED_DEFAULTS`) separate it."""
    exclusions = WEIGHTLESS_EXCLUDED if weightless else EXCLUDED

    def flat(config):
        return {k: json.dumps(v, sort_keys=True, default=str)
                for k, v in leaves(normalised(config, exclusions, experiment_of)).items()}
    old, new = flat(recorded), flat(today)
    return sorted({*(k for k, v in old.items() if new.get(k) != v),
                   *(changed_defaults(recorded, today) if not weightless else ())})


def digest(config: Mapping[str, Any], exclusions: Iterable[str] = EXCLUDED,
           experiment_of: Callable[[str], str] | None = None) -> str:
    """A 16-hex-digit hash of ``config`` without ``exclusions``, a pinned ``backbone.pretrained:
    run:<run_id>`` read as the experiment ``experiment_of`` names for that id."""
    kept = normalised(config, exclusions, experiment_of)
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(config: Mapping[str, Any], experiment_of: Callable[[str], str] | None = None) -> str:
    """The versioned fingerprint a ledger entry stores (``v1:<hash>``)."""
    return f"{VERSION}:{digest(config, EXCLUDED, experiment_of)}"




def weightless(config: Mapping[str, Any]) -> str:
    """The hash of ``config`` without ``backbone.pretrained`` (:data:`WEIGHTLESS_KINDS`)."""
    return digest(config, WEIGHTLESS_EXCLUDED)


#: The groups a composed vitexp config has; a config without them (an audit's arguments, a test's
#: stub) gets no fingerprint, and its runs are matched by name.
RUN_GROUPS = ("backbone", "method", "budget", "data", "recipe", "trainer")


def of_config(config: Mapping[str, Any] | None, experiment_of: Callable[[str], str] | None = None) -> str | None:
    """:func:`fingerprint` of a composed run config; ``None`` for anything else (:data:`RUN_GROUPS`)."""
    if not config or not all(isinstance(config.get(g), Mapping) for g in RUN_GROUPS):
        return None
    return fingerprint(config, experiment_of)


def of_record(record: Mapping[str, Any], experiment_of: Callable[[str], str] | None = None) -> str | None:
    """The entry's fingerprint: as stored when of this :data:`VERSION`; recomputed from its config
    when stored under another; ``None`` for an entry written before fingerprints (it has none)."""
    stored = record.get("fingerprint")
    if not stored:
        return None
    if str(stored).startswith(VERSION + ":"):
        return str(stored)
    return fingerprint(record.get("config") or {}, experiment_of)


def leaves(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of every leaf of ``config``."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping) and v:
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
