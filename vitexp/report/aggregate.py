"""Seeds of a table row -> mean ± sample std (n), and the paired difference to its baseline row.

Its reasoning: docs/tables.md, "vitexp/report/aggregate.py".
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Mapping, Sequence

from vitexp.ledger.index import SEED_NAME, run_seed, seeded_name  # noqa: F401 (the aggregate API too)
from vitexp.ledger.marks import old_order


def overlapping_order(run: dict[str, Any]) -> bool:
    """A completed training run of seed s >= 1 whose protocol lacks ``data_order``
    (:data:`vitexp.data.datamodules.DATA_ORDER`): its sampler drew epoch e from ``s + e``, so its second epoch
    repeated the first of seed s + 1 and the seeds of a row were not independent. Seed 0 drew the
    same orders under both samplers. Not judged: a running run (no protocol yet), a record without a
    protocol at all (a W&B run), and a run that took no training step (it drew no order)."""
    seed = run_seed(run)
    return old_order(run) and seed is not None and seed >= 1


def other_start(run: dict[str, Any], starts: Mapping[str, str | None], ledger) -> bool:
    """Whether ``run`` fine-tuned a run of a shared start other than the current one: ``starts`` maps
    each shared start's name to the run a table shows for it (``None``: it trains again, so every
    earlier run of it is another); ``ledger``: a :class:`vitexp.ledger.Ledger` (its start index)."""
    sid = ledger.start_of(run)
    exp = ledger.experiment_of(sid) if sid else None
    return exp in starts and starts[exp] != sid


def chosen(runs: Sequence[dict[str, Any]], keys: Iterable[str]) -> list[dict[str, Any]]:
    """The runs a row's cells read, oldest first: of each kind, the newest run that records any of
    ``keys``. A row's metrics of one kind then all come from one run (never one train run's top-1
    beside another's throughput); a FLOPs count and a benchmark of the row are runs of their own."""
    keys = tuple(keys)
    newest: dict[str, dict[str, Any]] = {}
    for r in runs:  # oldest first: the newest of each kind wins
        if any((r.get("metrics") or {}).get(k) is not None for k in keys):
            newest[r.get("kind", "")] = r
    picked = {id(r) for r in newest.values()}
    return [r for r in runs if id(r) in picked]


def per_seed_values(runs_by_seed: dict[int, list[dict[str, Any]]], key: str) -> dict[int, tuple[float, str]]:
    """{seed: (value, run_id)} from the newest run of each seed that has ``key``."""
    out = {}
    for seed, runs in runs_by_seed.items():
        for r in runs:  # oldest first: the newest wins
            v = (r.get("metrics") or {}).get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[seed] = (float(v), r["run_id"])
    return out


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """mean, sample std (ddof=1; ``None`` below two values) and n."""
    n = len(values)
    if n == 0:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if n > 1 else None, "n": n}


def seeded_cell(runs_by_seed: dict[int, list[dict[str, Any]]], key: str) -> dict[str, Any]:
    """A cell over seeds: ``value`` (the mean), ``std``, ``n``, ``expected`` (seeds asked for),
    ``seeds`` ({seed: value}) and ``run_ids``."""
    vals = per_seed_values(runs_by_seed, key)
    stats = summarize([v for v, _ in vals.values()])
    return {
        "value": stats["mean"],
        "std": stats["std"],
        "n": stats["n"],
        "expected": len(runs_by_seed),
        "seeds": {s: v for s, (v, _) in sorted(vals.items())},
        "run_ids": [rid for _, (_, rid) in sorted(vals.items())],
        "run_id": ", ".join(rid for _, (_, rid) in sorted(vals.items())) or None,
    }


def paired_difference(method: dict[int, float], baseline: dict[int, float]) -> dict[str, Any]:
    """mean ± sample std of ``method_s - baseline_s`` over the seeds both have; n = pairs."""
    common = sorted(set(method) & set(baseline))
    return {
        **summarize([method[s] - baseline[s] for s in common]),
        "seeds": common,
        "both_run": bool(method) and bool(baseline),
    }


def format_stat(
    mean: float | None,
    std: float | None,
    n: int,
    digits: int,
    expected: int | None = None,
    signed: bool = False,
) -> str | None:
    """``"90.12 ± 0.31 (3)"``; ``"(2 of 3 seeds)"`` when fewer than asked; ``None`` when n = 0."""
    if not n or mean is None:
        return None
    sign = "+" if signed else ""
    text = f"{mean:{sign}.{digits}f}"
    if std is not None and not math.isnan(std):
        text += f" ± {std:.{digits}f}"
    return text + (f" ({n} of {expected} seeds)" if expected and n < expected else f" ({n})")


def paired_columns(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The columns whose paired difference to the baseline row is shown (``paired: true``)."""
    return [c for c in spec["columns"] if c.get("paired")]


def paired_cells(spec: dict[str, Any], filled: list[dict[str, Any]]) -> None:
    """Add ``row["paired"][key]`` (the paired difference to the row's baseline) to every filled
    row that names a ``baseline``; a baseline that is not a seeded row of the table is an error."""
    by_experiment = {r["experiment"]: r for r in filled if r.get("experiment")}
    for row in filled:
        row["paired"] = {}
        base = row.get("baseline")
        if not base:
            continue
        if base not in by_experiment or by_experiment[base].get("seeds") is None:
            raise ValueError(
                f"{spec.get('name', 'table')}: row {row['label']!r} has baseline {base!r}, "
                "which is not the name of a seeded row; seeded rows: "
                f"{sorted(e for e, r in by_experiment.items() if r.get('seeds') is not None)}"
            )
        for col in paired_columns(spec):
            mine, theirs = row["cells"][col["key"]], by_experiment[base]["cells"][col["key"]]
            row["paired"][col["key"]] = paired_difference(mine.get("seeds") or {}, theirs.get("seeds") or {})


def paired_text(row: dict[str, Any], col: dict[str, Any]) -> str:
    """The Δ cell: ``"+0.40 ± 0.30 (3)"``; ``"—"`` without a baseline; ``"not run"`` until both rows
    have a seed; ``"no common seed"`` when they have only different ones."""
    diff = (row.get("paired") or {}).get(col["key"])
    if diff is None:
        return "—"
    expected = (row.get("cells") or {}).get(col["key"], {}).get("expected")
    text = format_stat(diff["mean"], diff["std"], diff["n"], int(col.get("digits", 2)), expected, signed=True)
    return text if text is not None else ("no common seed" if diff["both_run"] else "not run")


def csv_header(spec: dict[str, Any]) -> list[str]:
    """The CSV's columns for seeds: std and n of every column, and the paired differences."""
    head = [f"{c['key']}_{part}" for c in spec["columns"] for part in ("std", "n", "seeds_asked")]
    return head + [f"{c['key']}_delta_{part}" for c in paired_columns(spec) for part in ("mean", "std", "n")]


def csv_cells(spec: dict[str, Any], row: dict[str, Any]) -> list[Any]:
    line: list[Any] = []
    for c in spec["columns"]:
        cell = row["cells"][c["key"]]
        line += [_blank(cell.get("std")), _blank(cell.get("n")), _blank(cell.get("expected"))]
    for c in paired_columns(spec):
        diff = (row.get("paired") or {}).get(c["key"]) or {}
        line += [_blank(diff.get("mean")), _blank(diff.get("std")), _blank(diff.get("n"))]
    return line


def _blank(value: Any) -> Any:
    return "" if value is None else value
