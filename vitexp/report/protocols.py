"""A method's claims under several protocols: one generated table per ``sweeps/verdicts/<name>.yaml``.

Its reasoning: docs/tables.md, "vitexp/report/protocols.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from vitexp import PROJECT_ROOT
from vitexp.ledger.status import effective_status
from vitexp.report.aggregate import format_stat, paired_difference

VERDICTS_DIR = PROJECT_ROOT / "sweeps" / "verdicts"


def verdict_files() -> list[str]:
    return sorted(p.stem for p in VERDICTS_DIR.glob("*.yaml")) if VERDICTS_DIR.is_dir() else []


def load(name: str) -> dict[str, Any]:
    """A verdict file by name; its references are checked: ``table:row``, roles the claims use."""
    path = VERDICTS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"verdict file {path} not found; valid: {verdict_files()}")
    spec = {**yaml.safe_load(path.read_text()), "name": name}
    for proto in spec["protocols"]:
        for role, ref in proto["rows"].items():
            if ref.count(":") != 1:
                raise ValueError(
                    f"{name}: protocol {proto['label']!r}, role {role!r}: {ref!r} is not <table>:<row name>"
                )
    roles = {r for p in spec["protocols"] for r in p["rows"]}
    for claim in spec["claims"]:
        unknown = {claim["a"], claim["b"]} - roles
        if unknown:
            raise ValueError(
                f"{name}: claim {claim['label']!r} names roles {sorted(unknown)}; roles: {sorted(roles)}"
            )
    return spec


def tables_of(spec: dict[str, Any]) -> list[str]:
    return sorted({ref.split(":")[0] for p in spec["protocols"] for ref in p["rows"].values()})


def _cell(fill: Callable[[str], list[dict[str, Any]]], ref: str, key: str) -> dict[str, Any]:
    table, row = ref.split(":")
    match = [r for r in fill(table) if r.get("experiment") == row]
    if not match:
        raise ValueError(f"{ref}: table {table} has no row recorded as {row!r}")
    return match[0]["cells"][key]


def sign(pairs: list[float], needed: int = 1) -> str:
    """``supports``, ``contradicts`` or ``undecided`` (module docstring); ``not run`` without pairs,
    ``incomplete`` with fewer than ``needed``."""
    if not pairs:
        return "not run"
    if len(pairs) < needed:
        return "incomplete"
    if all(p > 0 for p in pairs):
        return "supports"
    if all(p < 0 for p in pairs):
        return "contradicts"
    return "undecided"


def both(test: str, val: str | None) -> str:
    """One protocol's sign from the test split's and the validation split's (module docstring)."""
    if val is None or test in ("not run", "incomplete"):
        return test
    if val in ("not run", "incomplete"):
        return "incomplete"
    return test if test == val else "split-dependent"


def verdict(signs: list[tuple[str, str]], noun: str = "protocol") -> str:
    """One claim's verdict from ``(column label, sign)`` pairs (module docstring); ``noun``: what a
    column is (``protocol``, ``backbone``)."""
    measured = [(p, s) for p, s in signs if s not in ("not run", "incomplete")]
    incomplete = sum(s == "incomplete" for _, s in signs)
    of = f"{len(measured)} of {len(signs)} {noun}s measured" + (
        f", {incomplete} incomplete" if incomplete else ""
    )
    if not measured:
        return f"no {noun} measured yet ({of})" if incomplete else f"not run ({of})"
    so_far = " so far" if len(measured) < len(signs) else ""  # a column still to come may disagree
    kinds = {s for _, s in measured}
    if kinds == {"supports"}:
        return f"holds under every measured {noun}{so_far} ({of})"
    if kinds == {"contradicts"}:
        return f"fails under every measured {noun}{so_far} ({of})"
    if len(kinds) == 1:  # undecided or split-dependent everywhere
        return f"{kinds.pop()} under every measured {noun}{so_far} ({of})"
    parts = [
        f"{s} under {', '.join(p for p, k in measured if k == s)}"
        for s in ("supports", "contradicts", "undecided", "split-dependent")
        if s in kinds
    ]
    return f"{noun}s disagree: {'; '.join(parts)} ({of})"


def _seconds(run: dict[str, Any]) -> float:
    """The CPU-seconds a run spent training: :func:`_wall_seconds` times its torch threads."""
    return _wall_seconds(run) * int((run.get("env") or {}).get("cpu_threads") or 1)


def _wall_seconds(run: dict[str, Any]) -> float:
    """What a run spent training: its ``fit_time_s``, else (a failed run) its attempts' fit time, else its
    wall clock from start to finish (a run whose process died while running: to its last heartbeat)."""
    metrics = run.get("metrics") or {}
    if metrics.get("fit_time_s") is not None:
        return float(metrics["fit_time_s"])
    if run.get("attempt_fit_time_s"):
        return float(
            sum(run["attempt_fit_time_s"].values())
            if isinstance(run["attempt_fit_time_s"], dict)
            else run["attempt_fit_time_s"]
        )
    from datetime import datetime

    try:
        end = run.get("finished") or run["heartbeat"]
        return max(
            0.0, (datetime.fromisoformat(end) - datetime.fromisoformat(run["started"])).total_seconds()
        )
    except (KeyError, TypeError, ValueError):
        return 0.0


def cost(
    spec: dict[str, Any], fill: Callable[[str], list[dict[str, Any]]], ledger: Any
) -> list[dict[str, Any]]:
    """Per protocol: ``runs`` (the cells' runs and their starts, each once), ``fit_s`` (each one's
    seconds) and ``hours`` (their sum); ``spent`` (every training run of the protocol's rows and
    starts under their names, any seed, completed or not, a ``running`` one whose process is gone
    included (:func:`vitexp.ledger.effective_status`): what the protocol spent, cited or not),
    ``spent_hours``, ``failed`` (the spent runs not completed), ``to_run`` (the (row, seed) pairs the cells
    lack) and ``to_run_hours`` (times the mean of the cited seeded runs; module docstring); ``ledger`` is a
    :class:`vitexp.ledger.Ledger`.
    """
    key, out = spec.get("key", "top1"), []
    for proto in spec["protocols"]:
        seen: dict[str, float] = {}
        todo = [rid for ref in proto["rows"].values() for rid in _cell(fill, ref, key).get("run_ids") or []]
        while todo:
            run = ledger.get(todo.pop())
            if run is None or run["run_id"] in seen:
                continue
            seen[run["run_id"]] = _seconds(run)
            start = ledger.start_of(run)
            if start:
                todo.append(start)
        names = {ref.split(":")[1] for ref in proto["rows"].values()}
        names |= {ledger.experiment_of(rid).split("+seed=")[0] for rid in seen}
        spent = {
            r["run_id"]: _seconds(r)
            for r in ledger.records
            if r.get("kind") == "train"
            and effective_status(r) in ("completed", "failed", "interrupted")
            and r["experiment"].split("+seed=")[0] in names
        }
        spent.update(seen)
        failed = sorted(rid for rid in spent if ledger.get(rid)["status"] != "completed")
        cells = {ref: _cell(fill, ref, key) for ref in proto["rows"].values()}
        missing = sum(
            max(0, (c.get("expected") or 0) - (c.get("n") or 0))
            for c in cells.values()
            if c.get("seeds") is not None
        )
        seeded = [
            seen[rid] for c in cells.values() if c.get("seeds") is not None for rid in c.get("run_ids") or []
        ]
        out.append(
            {
                "protocol": proto["label"],
                "runs": sorted(seen),
                "fit_s": seen,
                "hours": sum(seen.values()) / 3600,
                "spent": spent,
                "spent_hours": sum(spent.values()) / 3600,
                "failed": failed,
                "to_run": missing,
                "to_run_hours": missing * sum(seeded) / len(seeded) / 3600 if seeded else None,
            }
        )
    return out


def _pairs(pair: list[dict[str, Any]], digits: int, needed: int) -> dict[str, Any]:
    """The paired difference a − b of two table cells: its text (marks carried), pairs, stats and sign."""
    a, b = (c.get("seeds") or {} for c in pair)
    diff = paired_difference(a, b)
    pairs = [a[s] - b[s] for s in diff["seeds"]]
    marked = "".join(sorted(set("".join(c.get("marks") or "" for c in pair)))) if diff["n"] else ""
    text = (format_stat(diff["mean"], diff["std"], diff["n"], digits, signed=True) or "not run") + (
        f" {marked}" if marked else ""
    )
    return {**diff, "text": text, "pairs": pairs, "marks": marked, "sign": sign(pairs, needed)}


def evaluate(spec: dict[str, Any], fill: Callable[[str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each claim with its cell per protocol (``text``, ``sign``, the difference's stats) and verdict;
    ``fill(table)`` gives a table's filled rows (:func:`vitexp.report.tables.fill`)."""
    filled = {t: fill(t) for t in tables_of(spec)}
    fill = filled.__getitem__
    digits, needed, noun = (
        int(spec.get("digits", 2)),
        int(spec.get("pairs", 1)),
        spec.get("column", "protocol"),
    )
    val_key = spec.get("val_key")
    out = []
    for claim in spec["claims"]:
        key = claim.get("key", spec.get("key", "top1"))
        cells = []
        for proto in spec["protocols"]:
            rows = proto["rows"]
            if claim["a"] not in rows or claim["b"] not in rows:
                cells.append({"protocol": proto["label"], "text": "not in this protocol", "sign": None})
                continue
            need = int(proto.get("pairs", needed))
            test = _pairs([_cell(fill, rows[claim[role]], key) for role in ("a", "b")], digits, need)
            val = (
                _pairs([_cell(fill, rows[claim[role]], val_key) for role in ("a", "b")], digits, need)
                if val_key
                else None
            )
            sign_ = both(test["sign"], val and val["sign"])
            interim = both(sign(test["pairs"]), val and sign(val["pairs"])) if sign_ == "incomplete" else None
            text = (
                test["text"]
                if val is None or not (test["n"] or val["n"])
                else f"test {test['text']}; val {val['text']}"
            )
            cells.append(
                {
                    "protocol": proto["label"],
                    "text": text,
                    "sign": sign_,
                    "needed": need,
                    "interim": interim,
                    "marks": test["marks"],
                    "n": test["n"],
                    "mean": test["mean"],
                    "std": test["std"],
                    "val": val and {k: val[k] for k in ("n", "mean", "std", "sign")},
                    "reference": bool(proto.get("reference")),
                }
            )
        voting = [c for c in cells if not c.get("reference")]
        judged = [(c["protocol"], c["sign"]) for c in voting if c["sign"] is not None]
        pending = [f"{c['protocol']}: {c['text']}" for c in voting if c["sign"] == "incomplete"]
        leaning = [
            f"{c['protocol']} ({c['marks']})"
            for c in voting
            if c.get("marks") and c["sign"] in ("supports", "contradicts", "undecided", "split-dependent")
        ]
        text = (
            verdict(judged, noun)
            + (f"; not yet judged: {'; '.join(pending)}" if pending else "")
            + (f"; rests on marked runs under {', '.join(leaning)}" if leaning else "")
        )
        out.append({"claim": claim["label"], "cells": cells, "verdict": text})
    return out


def _count(cell: dict[str, Any]) -> str:
    """An incomplete cell's pairs: per split where the splits have different numbers (validation not
    run while the test split is complete), else one count."""
    val = cell.get("val")
    if val and val["n"] != cell["n"]:
        return f"test {cell['n']}, val {val['n']} of {cell['needed']} pairs"
    return f"{cell['n']} of {cell['needed']} pairs"


def render(
    spec: dict[str, Any], claims: list[dict[str, Any]], costs: list[dict[str, Any]] | None = None
) -> str:
    """The markdown table: a row per claim, a column per protocol, then the verdict; with ``costs``
    (:func:`cost`) a last row of training hours per protocol."""
    head = ["Claim (a − b)"] + [p["label"] for p in spec["protocols"]] + ["Verdict"]
    lines = [f"# {spec['title']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in claims:
        cells = [
            (
                x["text"]
                if x["sign"] in (None, "not run")
                else (
                    f"{x['text']} (incomplete: {_count(x)}"
                    + (
                        f"; {x['interim']} so far"
                        if x.get("interim") not in (None, "not run", "incomplete")
                        else ""
                    )
                    + ("; not counted)" if x.get("reference") else ")")
                    if x["sign"] == "incomplete"
                    else f"{x['text']} ({x['sign']}{'; not counted' if x.get('reference') else ''})"
                )
            )
            for x in c["cells"]
        ]
        lines.append("| " + " | ".join([c["claim"]] + cells + [c["verdict"]]) + " |")
    if costs is not None:

        def runs(n: int) -> str:
            return f"{n} run{'s' if n != 1 else ''}"

        def spent(hours: float, n: int, failed: int) -> str:
            return f"{hours:.2f} h spent ({runs(n)}" + (f", {failed} not completed)" if failed else ")")

        every = {rid: sec for c in costs for rid, sec in c["fit_s"].items()}  # a run in two protocols once
        all_spent = {rid: sec for c in costs for rid, sec in c.get("spent", c["fit_s"]).items()}
        failed = len({rid for c in costs for rid in c.get("failed", ())})
        cells = [
            (
                f"{c['hours']:.2f} h cited ({runs(len(c['runs']))}); "
                + spent(
                    c.get("spent_hours", c["hours"]), len(c.get("spent", c["runs"])), len(c.get("failed", ()))
                )
                + (
                    f"; to run: {runs(c['to_run'])}"
                    + (f", about {c['to_run_hours']:.1f} h" if c.get("to_run_hours") else "")
                    if c.get("to_run")
                    else ""
                )
                if c["runs"]
                else "not run"
            )
            for c in costs
        ]
        lines.append(
            "| Cost: training, CPU-hours (time × the run's threads) | " + " | ".join(cells) + " | "
            f"{sum(every.values()) / 3600:.2f} h cited ({runs(len(every))}); "
            f"{spent(sum(all_spent.values()) / 3600, len(all_spent), failed)} in all |"
        )
    noun = spec.get("column", "protocol")
    splits = (
        f" on the test split and (val) on the validation split ({spec['val_key']}: the same deployed model)"
        if spec.get("val_key")
        else ""
    )
    lines += [
        "",
        "Cells: the paired difference of " + spec.get("unit", "top-1 (%)") + splits + ", a − b, over the "
        "seeds both rows completed, mean ± sample std (n pairs). supports: every pair above 0"
        + (" on both splits" if splits else "")
        + "; contradicts: every pair below 0"
        + (" on both splits" if splits else "")
        + "; undecided: pairs of both signs"
        + ("; split-dependent: the two splits' signs differ, which is no support" if splits else "")
        + f". A verdict is given only where the measured {noun}s agree."
        + (
            f" A cell with fewer than {spec['pairs']} pairs (or its {noun}'s own "
            "pairs) is incomplete: it is shown with its sign so far, not judged, and counts as not measured."
            if spec.get("pairs", 1) > 1
            else ""
        ),
    ]
    if any(p.get("reference") for p in spec["protocols"]):
        lines += [
            "",
            (
                f"A cell marked 'not counted' is a reference {noun}'s: shown for comparison, it enters no"
                f" verdict and no count of {noun}s measured (the {noun}s below say why); its runs are in the"
                " cost row, which counts what was spent."
            ),
        ]
    if any(x.get("marks") for c in claims for x in c["cells"]):
        lines += [
            "",
            (
                "A mark after a cell is carried over from a table cell it pairs (‡: a run trained from a"
                " dirty tree whose code cannot be rebuilt; §: a protocol today's code does not reproduce):"
                " that table's notes say which runs."
            ),
        ]
    if costs is not None:
        lines += [
            "",
            (
                "Cost: the ledger's fit_time_s (training, test excluded) times the run's torch threads"
                " (env.cpu_threads), summed in CPU-hours. Cited: the runs in the cells and the runs whose"
                " weights they loaded (a shared start counted once). Spent: every training run recorded"
                " under the names of those rows and starts, cited or not, completed or not (a run that"
                " failed before recording its fit time: its wall clock, times its threads). To run: the"
                " (row, seed) pairs its cells still lack, times the mean fit time of its seeded runs (an"
                f" estimate). In all, a run that two {noun}s share counted once."
            ),
        ]
    lines += ["", f"{noun.capitalize()}s (rows from the tables named):", ""]
    lines += [
        f"- **{p['label']}**"
        + (f" (not counted: {' '.join(str(p['reference']).split())})" if p.get("reference") else "")
        + ": "
        + ", ".join(f"{role} = `{ref}`" for role, ref in p["rows"].items())
        for p in spec["protocols"]
    ]
    lines += [f"- {n}" for n in spec.get("notes") or []]
    return "\n".join(lines) + "\n"


#: The line before a claim table's prose (:mod:`vitexp.report.protocol_prose`), which pages also show.
PROSE_HEAD = "**The verdicts in words**"


def text(
    name: str,
    fill: Callable[[str], list[dict[str, Any]]],
    ledger: Any,
    load_spec: Callable[[str], dict[str, Any]],
) -> str:
    """The markdown of verdict file ``name``: :func:`render` with its cost row from ``ledger``, then
    its prose (:func:`vitexp.report.protocol_prose.summary`) after :data:`PROSE_HEAD`; ``load_spec`` reads a
    table spec for the caveats (:func:`vitexp.report.tables.load_spec`)."""
    from vitexp.report.protocol_prose import caveats, summary

    filled: dict[str, list[dict[str, Any]]] = {}  # each table filled once (the cost row asks per cell)

    def fill_once(table: str) -> list[dict[str, Any]]:
        if table not in filled:
            filled[table] = fill(table)
        return filled[table]

    spec = load(name)
    claims, costs = evaluate(spec, fill_once), cost(spec, fill_once, ledger)
    return (
        render(spec, claims, costs)
        + "\n"
        + PROSE_HEAD
        + "\n\n"
        + summary(spec, claims, costs, caveats(spec, fill_once, load_spec))
    )


def prose(markdown: str) -> str:
    """The prose part of :func:`text`'s markdown (what the pages' blocks hold)."""
    return markdown.split("\n" + PROSE_HEAD + "\n\n", 1)[1]


def write(
    names: Iterable[str], text_of: Callable[[str], str], out_dir: Path, writer: Callable[[Path, str], Any]
) -> dict[str, dict[str, str]]:
    """Write ``<out_dir>/<name>.md`` for each verdict file, its markdown from ``text_of(name)``
    (:func:`text`); ``{name: {"md": path}}``."""
    written = {}
    for name in names:
        path = Path(out_dir) / f"{name}.md"
        writer(path, text_of(name))
        written[name] = {"md": str(path)}
    return written
