"""``vitexp-sweep TABLE --kind eval``: re-evaluate the weights behind every accuracy cell of a table.

Its reasoning: docs/commands.md, "vitexp/commands/recheck.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from vitexp.config.rows import composing, expand_rows, row_query
from vitexp.ledger import Ledger
from vitexp.report.aggregate import per_seed_values
from vitexp.training.objectives import objective_for

#: points of top-1; one image of a 10,000-image test set
DEFAULT_TOLERANCE = 0.01
#: float32 percentages: 90.01 - 90.0 is a little more than 0.01
FLOAT_SLACK = 1e-6


def training_rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The spec's rows that train (not cited, not a FLOPs count or a benchmark)."""
    return [
        row
        for row in expand_rows(spec["rows"])
        if not row.get("cited") and row.get("experiment") and row.get("run", "train") == "train"
    ]


def _row_runs(spec: dict[str, Any], ledger: Ledger) -> list[tuple[str, dict[Any, list[dict[str, Any]]]]]:
    """[(row name, {seed (None for an unseeded row): its completed training runs, oldest first})]
    per training row, found as :func:`vitexp.report.tables.fill` finds them
    (:meth:`vitexp.ledger.Ledger.row_runs`).
    """
    out = []
    with composing():
        for row in training_rows(spec):
            query = row_query(spec, row)
            found = ledger.row_runs(query)
            out.append(
                (
                    query.name,
                    {
                        s: [r for r in rs if r["kind"] == "train" and r["status"] == "completed"]
                        for s, rs in found.items()
                    },
                )
            )
    return out


def headline(run: dict[str, Any]) -> tuple[str, ...]:
    """The metrics ``run`` is checked on: its objective's headline (``top1``; ``ap_box``, ``ap_mask``)."""
    return tuple(objective_for(run.get("config") or {}).headline)


def _values(run: dict[str, Any] | None, keys: tuple[str, ...]) -> dict[str, float] | None:
    """{key: value} of ``run``'s metrics, ``None`` unless it recorded every one of ``keys``."""
    metrics = (run or {}).get("metrics") or {}
    out = {k: metrics.get(k) for k in keys}
    if run is None or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in out.values()):
        return None
    return {k: float(v) for k, v in out.items()}


def not_checkable(spec: dict[str, Any], results_dir: Path, ledger: Ledger | None = None) -> list[str]:
    """Completed training runs of the spec's training rows without their headline metrics."""
    found = [
        r["run_id"]
        for _, by_seed in _row_runs(spec, ledger or Ledger.load(results_dir))
        for rs in by_seed.values()
        for r in rs
        if _values(r, headline(r)) is None
    ]
    return list(dict.fromkeys(found))


def cited_runs(spec: dict[str, Any], results_dir: Path, ledger: Ledger | None = None) -> list[dict[str, Any]]:
    """[{"row": name, "seed": seed or None, "run_id": id, "metrics": {headline metric: ledger value}}]
    for every training row of the spec, in row order; rows and seeds without a completed run with
    its headline metrics are left out."""
    out: list[dict[str, Any]] = []
    ledger = ledger or Ledger.load(results_dir)
    for name, by_seed in _row_runs(spec, ledger):
        picked = []
        for seed, runs in by_seed.items():
            keys = headline(runs[-1]) if runs else ()
            newest = per_seed_values({seed: runs}, keys[0]).get(seed) if keys else None  # (value, run_id)
            run = ledger.get(newest[1]) if newest else None
            values = _values(run, keys)
            if values is not None:
                picked.append((seed, values, run["run_id"]))
        for seed, values, run_id in sorted(picked, key=lambda p: (p[0] is not None, p[0] or 0)):
            if not any(c["run_id"] == run_id for c in out):  # a row shared by two labels is evaluated once
                out.append({"row": name, "seed": seed, "run_id": run_id, "metrics": values})
    return out


def evaluations(
    results_dir: Path, before: set[str] = frozenset(), ledger: Ledger | None = None
) -> dict[str, dict[str, Any]]:
    """{train run_id: its newest completed eval entry} (:meth:`vitexp.ledger.Ledger.evaluations`)."""
    return (ledger or Ledger.load(results_dir)).evaluations(before)


def to_evaluate(spec: dict[str, Any], results_dir: Path, force: bool = False) -> list[str]:
    """The cited runs without a completed eval entry (every cited run with ``force``)."""
    ledger = Ledger.load(results_dir)
    done = evaluations(results_dir, ledger=ledger)
    return [c["run_id"] for c in cited_runs(spec, results_dir, ledger) if force or c["run_id"] not in done]


def recheck(
    spec: dict[str, Any],
    results_dir: Path,
    evaluate: Callable[[str], int],
    force: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict[str, Any]:
    """Evaluate (``evaluate(run_id)`` -> return code) every cited run without a completed eval entry
    (every one with ``force``), then compare: {"runs": [{row, seed, run_id, metrics, eval_metrics,
    diff: {metric: eval - ledger}, eval_run_id, evaluated_now, agrees}], "disagree": [run_ids],
    "not_evaluated": [run_ids whose evaluation failed or recorded no headline], "not_checkable":
    [run_ids without their headline metrics]}."""
    ledger = Ledger.load(results_dir)
    ledger.check(n for n, _ in _row_runs(spec, ledger))
    cited = cited_runs(spec, results_dir, ledger)
    done = evaluations(results_dir, ledger=ledger)
    before = {r["run_id"] for r in ledger if r["kind"] == "eval"}
    failed = []
    for c in cited:
        c["evaluated_now"] = force or c["run_id"] not in done
        if c["evaluated_now"] and evaluate(c["run_id"]) != 0:
            failed.append(c["run_id"])
    done = evaluations(results_dir, before)
    rows, disagree, missing = [], [], []
    for c in cited:
        entry = done.get(c["run_id"])
        values = _values(entry, tuple(c["metrics"])) if c["run_id"] not in failed else None
        if values is None:
            missing.append(c["run_id"])
            rows.append({**c, "eval_metrics": None, "diff": None, "eval_run_id": None, "agrees": None})
            continue
        diff = {k: values[k] - v for k, v in c["metrics"].items()}
        agrees = all(abs(d) <= tolerance + FLOAT_SLACK for d in diff.values())
        if not agrees:
            disagree.append(c["run_id"])
        rows.append(
            {**c, "eval_metrics": values, "diff": diff, "eval_run_id": entry["run_id"], "agrees": agrees}
        )
    return {
        "runs": rows,
        "disagree": disagree,
        "not_evaluated": missing,
        "tolerance": tolerance,
        "not_checkable": not_checkable(spec, results_dir, ledger),
    }


def report_lines(result: dict[str, Any]) -> list[str]:
    """One line per cited run: each headline metric in the ledger, re-evaluated, and their difference."""
    lines = [
        f"{run_id}: no headline metric recorded, nothing to compare" for run_id in result["not_checkable"]
    ]
    for r in result["runs"]:
        seed = "" if r["seed"] is None else f" seed {r['seed']}"
        ledger_text = ", ".join(f"{k} {v:.2f} %" for k, v in r["metrics"].items())
        if r["eval_metrics"] is None:
            lines.append(
                f"{r['row']}{seed}: {ledger_text} in the ledger; not re-evaluated (vitexp-eval failed)"
            )
            continue
        verdict = "agrees" if r["agrees"] else f"DISAGREES (tolerance {result['tolerance']} points)"
        pairs = "; ".join(
            f"{k} {v:.2f} % in the ledger, {r['eval_metrics'][k]:.2f} % re-evaluated ({r['diff'][k]:+.3f})"
            for k, v in r["metrics"].items()
        )
        lines.append(f"{r['row']}{seed}: {pairs}; {verdict}; {r['run_id']}")
    return lines
