"""Table rows as runs: a row of a spec (``sweeps/<table>.yaml``) is a base experiment plus Hydra overrides,
and a ``grid`` row stands for one row per combination of its variables.

Its reasoning: docs/commands.md, "vitexp/config/rows.py".
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping, Sequence

from vitexp.ledger import RowQuery
from vitexp.ledger.index import seeded_name

#: Override keys a row may not set through ``overrides`` (they are row keys of their own).
RESERVED = ("seed", "experiment", "name")
#: Characters a ledger name may not hold (it travels to Hydra as a quoted string).
UNQUOTABLE = ("'", '"', "\\", "$", "{", "}")


def expand_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spec's rows with every ``grid`` row replaced by its rows (plain rows unchanged)."""
    out: list[dict[str, Any]] = []
    for row in rows:
        out += _expand_grid(row) if "grid" in row else [row]
    return out


def _combinations(grid: Any, label: Any) -> list[dict[str, Any]]:
    if not isinstance(grid, dict) or not grid or not all(isinstance(v, list) and v for v in grid.values()):
        raise ValueError(
            f"grid row {label!r}: grid must map each variable to a non-empty list of values, got {grid!r}"
        )
    axes = [[v if isinstance(v, dict) else {var: v} for v in values] for var, values in grid.items()]
    return [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*axes)]


def _format(value: Any, variables: dict[str, Any], label: Any) -> Any:
    if isinstance(value, str):
        try:
            return value.format(**variables)
        except (KeyError, IndexError) as err:
            raise ValueError(
                f"grid row {label!r}: {value!r} names {err} but the grid's variables are {sorted(variables)}"
            ) from None
    if isinstance(value, list):
        return [_format(v, variables, label) for v in value]
    if isinstance(value, dict):
        return {k: _format(v, variables, label) for k, v in value.items()}
    return value


def _expand_grid(row: dict[str, Any]) -> list[dict[str, Any]]:
    template = {k: v for k, v in row.items() if k not in ("grid", "by_name")}
    by_name = dict(row.get("by_name") or {})
    rows = []
    for variables in _combinations(row["grid"], row.get("label")):
        expanded = _format(template, variables, row.get("label"))
        extra = by_name.pop(row_name(expanded), None)
        rows.append({**expanded, **(extra or {})})
    if by_name:
        raise ValueError(
            f"grid row {row.get('label')!r}: by_name names {sorted(by_name)}, which are not names of "
            f"its rows: {[row_name(r) for r in rows]}"
        )
    return rows


def row_overrides(row: dict[str, Any]) -> list[str]:
    """The row's overrides, checked: a list of ``key=value`` strings without a reserved key."""
    overrides = row.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise ValueError(
            f"row {row.get('label')!r}: overrides must be a list of key=value strings, got {overrides!r}"
        )
    for ov in overrides:
        if ov.split("=", 1)[0].lstrip("+~") in RESERVED:
            raise ValueError(
                f"row {row.get('label')!r}: override {ov!r} is a row key of its own "
                "(seeds: the row's seeds; experiment and name: the row's keys)"
            )
    return overrides


def row_name(row: dict[str, Any]) -> str | None:
    """The ledger name of the row's runs (module docstring); ``None`` for a row without experiment."""
    if not row.get("experiment"):
        return None
    overrides = row_overrides(row)
    name = row.get("name") or (
        f"{row['experiment']}+{','.join(overrides)}" if overrides else row["experiment"]
    )
    if not isinstance(name, str) or any(c in name for c in UNQUOTABLE):
        raise ValueError(
            f"row {row.get('label')!r}: name {name!r} may not contain any of {' '.join(UNQUOTABLE)}"
        )
    return name


def is_plain(row: dict[str, Any]) -> bool:
    """A row that is its experiment as configured (no overrides, no seed of its own, recorded under the
    experiment's name)."""
    return not row_overrides(row) and row_seed(row) is None and row_name(row) == row["experiment"]


def row_seed(row: dict[str, Any]) -> int | None:
    """The ``seed`` key of an unseeded row (a start pretrained with a seed other than its
    experiment's: one start of several, docs/verdicts.md); ``None`` without the key. Refuses a
    non-integer seed, a row without a name of its own, and a ``seed`` beside ``seeds`` other than
    ``null``."""
    if "seed" not in row:
        return None
    seed = row["seed"]
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"row {row.get('label')!r}: seed must be an integer, got {seed!r}")
    if not row.get("name"):
        raise ValueError(f"row {row.get('label')!r}: a row with a seed of its own needs a name of its own")
    if row.get("seeds", "") is not None:
        raise ValueError(
            f"row {row.get('label')!r}: seed {seed} is one run's seed, for a row with seeds: null "
            f"(this row's seeds: {row.get('seeds', 'those of the table')!r})"
        )
    return seed


def row_weights(row: dict[str, Any]) -> str | None:
    """The ``backbone.pretrained`` of the row's ``weights`` key (:mod:`vitexp.config.weights`):
    ``weights:<tag>`` for a tag of ``conf/weights.yaml``, ``run:<row name>`` as given; ``None``
    without the key."""
    weights = row.get("weights")
    if weights is None:
        return None
    from vitexp.config.weights import PREFIX, weights_map

    if isinstance(weights, str) and weights.startswith("run:") and len(weights) > 4:
        return weights
    if not isinstance(weights, str) or weights not in weights_map():
        raise ValueError(
            f"row {row.get('label')!r}: weights {weights!r} is neither run:<row name> nor a tag of "
            f"conf/weights.yaml ({sorted(weights_map())})"
        )
    return PREFIX + weights


def job_arguments(row: dict[str, Any], seeded: bool, weights: bool = True) -> list[str]:
    """The Hydra arguments of the row's job (the seeds, for a seeded row, are the caller's):
    ``experiment=E`` for a plain unseeded row (``experiment=E seed=s`` names itself ``E+seed=s``),
    else the base, the overrides, the row's starting weights (``weights``: its ``weights`` key; a
    FLOPs count or a timing loads none), an unseeded row's own ``seed`` and the row's name."""
    start = row_weights(row) if weights else None
    if is_plain(row) and start is None:
        return [f"experiment={row['experiment']}"]
    name = row_name(row)
    name = seeded_name(name, "${seed}") if seeded else name  # type: ignore[arg-type]
    loads = [f"backbone.pretrained={start}"] if start else []
    own_seed = [] if seeded or row_seed(row) is None else [f"seed={row_seed(row)}"]
    return [f"experiment={row['experiment']}", *row_overrides(row), *loads, *own_seed, f"name='{name}'"]


def check_rows(rows: list[dict[str, Any]], where: str) -> None:
    """Every row's overrides and name are well formed, and two rows that are different runs do
    not share a name (the ledger could not tell their runs apart)."""
    seen: dict[str, tuple[Any, ...]] = {}
    for row in rows:
        name = row_name(row)
        if name is None:
            continue
        row_weights(row)
        what = (row["experiment"], tuple(row_overrides(row)), row_seed(row))
        if seen.setdefault(name, what) != what:
            raise ValueError(
                f"{where}: rows {seen[name]} and {what} are both recorded as {name!r}; give one of them a"
                " name of its own"
            )


#: {job arguments: the composed, unresolved config (``None``: it does not compose today)}, per process.
_COMPOSED: dict[tuple[str, ...], Any] = {}
#: {job arguments: Hydra's group choices of its composition ({group: option})}, per process.
_CHOICES: dict[tuple[str, ...], dict[str, str]] = {}
#: {(group, option): the group file's contents, unresolved, with the files it extends}, per process.
_GROUP_FILES: dict[tuple[str, str], dict[str, Any] | None] = {}
#: Inside :func:`composing`: the Hydra instance rows compose with, and the one it replaced.
_HYDRA: dict[str, Any] = {}


def _compose(job: tuple[str, ...]) -> Any:
    """The job's config as Hydra composes it (unresolved), or ``None`` when it does not compose
    today (an experiment file since removed, a key since renamed)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import vitexp.config.composition  # noqa: F401 - registers the resolvers the configs interpolate (${vitexp_root:}, ...)
    from vitexp import CONF_DIR

    experiment = next((a.split("=", 1)[1] for a in job if a.startswith("experiment=")), None)
    if experiment and not (CONF_DIR / "experiment" / f"{experiment}.yaml").is_file():
        return None
    hydra = GlobalHydra.instance()
    ours = _HYDRA.get("ours")
    if ours is not None and hydra.hydra is ours:  # inside composing(): initialised once for many rows
        try:
            return _with_choices(job, compose("train", overrides=list(job), return_hydra_config=True))
        except Exception:  # noqa: BLE001 - a row that no longer composes is matched by name
            return None
    running = hydra.hydra
    try:
        hydra.clear()
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
        if "depth" in _HYDRA:
            _HYDRA["ours"], _HYDRA["running"] = hydra.hydra, running
            running = None  # restored when composing() ends
        return _with_choices(job, compose("train", overrides=list(job), return_hydra_config=True))
    except Exception:  # noqa: BLE001 - a row that no longer composes is matched by name
        return None
    finally:
        if "depth" not in _HYDRA:
            hydra.clear()
        if running is not None and not hydra.is_initialized():
            hydra.initialize(running)


def _with_choices(job: tuple[str, ...], cfg: Any) -> Any:
    """``cfg`` without its ``hydra`` node, whose group choices are kept in :data:`_CHOICES`."""
    from omegaconf import OmegaConf, open_dict

    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    _CHOICES[job] = {g: str(o) for g, o in choices.items() if o is not None and not g.startswith("hydra/")}
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _group_file(group: str, option: str) -> dict[str, Any] | None:
    """``conf/<group>/<option>.yaml``, unresolved, merged over the files of its group it extends
    (its ``defaults`` list; ``_self_`` last unless placed); ``None`` when there is no such file."""
    from omegaconf import OmegaConf

    from vitexp import CONF_DIR

    if (group, option) in _GROUP_FILES:
        return _GROUP_FILES[group, option]
    path = CONF_DIR / group / f"{option}.yaml"
    own = OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.is_file() else None
    merged: dict[str, Any] | None = None
    if isinstance(own, dict):
        parents = own.pop("defaults", None) or []
        order = parents if "_self_" in parents else [*parents, "_self_"]
        merged = {}
        for item in order:
            part = own if item == "_self_" else _group_file(group, item) if isinstance(item, str) else None
            if part is None:  # an entry of another form: this group file has no plain default
                merged = None
                break
            merged = OmegaConf.to_container(OmegaConf.merge(merged, part), resolve=False)
    _GROUP_FILES[group, option] = merged
    return merged


def _primary() -> dict[str, Any]:
    """``conf/train.yaml``'s own keys (no defaults list, no ``hydra``), unresolved."""
    from omegaconf import OmegaConf

    from vitexp import CONF_DIR

    if ("", "train") not in _GROUP_FILES:
        own = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "train.yaml"), resolve=False)
        _GROUP_FILES["", "train"] = {k: v for k, v in own.items() if k not in ("defaults", "hydra")}
    return _GROUP_FILES["", "train"]


def group_default(key: str, choices: Mapping[str, str], config: Mapping[str, Any]) -> Any:
    """The default of the dotted ``key`` where it is written: the group file of its first part's
    choice (``choices``, Hydra's), or ``conf/train.yaml`` for a key of no group; an interpolation
    resolved in ``config`` (the row's resolved config). :data:`vitexp.ledger.fingerprint.NO_DEFAULT`
    when no file gives it one (a key an experiment added, a group file that extends another kind)."""
    from omegaconf import OmegaConf

    from vitexp.ledger.fingerprint import NO_DEFAULT

    group, _, rest = key.partition(".")
    node: Any = _group_file(group, choices[group]) if group in choices else _primary()
    for part in (rest if group in choices else key).split("."):
        if not isinstance(node, dict) or part not in node:
            return NO_DEFAULT
        node = node[part]
    if isinstance(node, str) and "${" in node:
        try:
            value = OmegaConf.create({**config, "_default_": node})._default_
            return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except Exception:  # noqa: BLE001 - an interpolation that needs a running app: no default to compare
            return NO_DEFAULT
    return node


@contextmanager
def composing() -> Iterator[None]:
    """Rows composed inside share one Hydra initialisation (a third of a compose's time); on leaving,
    Hydra's global state is as it was (a Hydra app in the same process starts as usual)."""
    from hydra.core.global_hydra import GlobalHydra

    if "depth" in _HYDRA:
        yield
        return
    _HYDRA["depth"] = 1
    try:
        yield
    finally:
        ours, running = _HYDRA.pop("ours", None), _HYDRA.pop("running", None)
        _HYDRA.pop("depth")
        hydra = GlobalHydra.instance()
        if ours is not None and hydra.hydra is ours:
            hydra.clear()
            if running is not None:
                hydra.initialize(running)


def runnable_rows(spec: Mapping[str, Any]) -> Iterator[tuple[dict[str, Any], str, list[int] | None]]:
    """(row, ledger name, seeds) of every row of ``spec`` that is a run (neither cited nor without an
    experiment), in the spec's order, inside one Hydra initialisation (:func:`composing`)."""
    with composing():
        for row in expand_rows(spec["rows"]):
            if row.get("cited") or not row.get("experiment"):
                continue
            yield row, row_name(row), row_seeds(dict(spec), row)


def composed_config(job: Sequence[str], seed: int | None) -> dict[str, Any] | None:
    """The resolved config of ``job`` (Hydra arguments) with ``seed`` (``None``: its own), as a run
    of it records it (paths and the name are excluded from fingerprints, so placeholders do)."""
    from omegaconf import OmegaConf, open_dict

    key = tuple(job)
    if key not in _COMPOSED:
        _COMPOSED[key] = _compose(key)
    if _COMPOSED[key] is None:
        return None
    cfg = _COMPOSED[key].copy()
    with open_dict(cfg):
        cfg.output_dir = "."
        if seed is not None:
            cfg.seed = seed
    try:
        out = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - an interpolation that needs a running app: matched by name
        return None
    out.pop("hydra", None)
    return out


def row_query(spec: Mapping[str, Any], row: dict[str, Any], overrides: Sequence[str] = ()) -> RowQuery | None:
    """What the ledger needs to find the row's runs (``None`` for a row without experiment);
    ``overrides``: those the row was swept with (the ones that change no fingerprint are dropped:
    ``hydra/launcher=slurm``, ``data.root=...``)."""
    name = row_name(row)
    if name is None:
        return None
    from vitexp.ledger.fingerprint import excluded

    changing = [
        ov for ov in overrides if not excluded(key := ov.split("=", 1)[0].lstrip("+~")) and "/" not in key
    ]
    job = (*job_arguments(row, seeded=False), *changing)
    return RowQuery(
        name,
        row["experiment"],
        row_seeds(dict(spec), row),
        lambda seed: composed_config(job, seed),
        own_name=bool(row.get("start") or shared_start(dict(spec), row)),
        default_of=lambda key, config: group_default(key, _CHOICES.get(job, {}), config),
    )


def row_seeds(spec: dict[str, Any], row: dict[str, Any]) -> list[int] | None:
    """The seeds a row asks for (its own ``seeds``, else the table's); ``None``: not seeded."""
    seeds = row["seeds"] if "seeds" in row else spec.get("seeds")
    if seeds is None:
        return None
    if not isinstance(seeds, (list, tuple)) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ValueError(
            f"row {row.get('label')!r}: seeds must be a non-empty list of integers, got {seeds!r}"
        )
    return [int(s) for s in seeds]


def shared_start(spec: dict[str, Any], row: dict[str, Any]) -> bool:
    """A row with ``seeds: null`` in a seeded table: the pretrained start its seeded rows load."""
    return bool(spec.get("seeds")) and "seeds" in row and row["seeds"] is None
