"""A method's claims under several protocols: one generated table per ``sweeps/verdicts/<name>.yaml``.

Its reasoning: docs/tables.md, "vitexp/report/protocols.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from vitexp import PROJECT_ROOT
from vitexp.ledger.status import effective_status
from vitexp.report import verdict_rule as rule
from vitexp.report.aggregate import format_stat, summarize

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
        for role in proto["rows"]:
            for ref in refs(proto, role):
                if not isinstance(ref, str) or ref.count(":") != 1:
                    raise ValueError(
                        f"{name}: protocol {proto['label']!r}, role {role!r}: {ref!r} is not"
                        " <table>:<row name>"
                    )
    roles = {r for p in spec["protocols"] for r in p["rows"]}
    for claim in spec["claims"]:
        unknown = {claim["a"], claim["b"]} - roles
        if unknown:
            raise ValueError(
                f"{name}: claim {claim['label']!r} names roles {sorted(unknown)}; roles: {sorted(roles)}"
            )
    return spec


def refs(proto: dict[str, Any], role: str) -> list[str]:
    """The ``table:row`` references of a protocol's role: one, or a list (the role's rows from several
    starts, paired by start: docs/verdicts.md)."""
    ref = proto["rows"][role]
    return list(ref) if isinstance(ref, (list, tuple)) else [ref]


def all_refs(proto: dict[str, Any]) -> list[str]:
    return [ref for role in proto["rows"] for ref in refs(proto, role)]


def tables_of(spec: dict[str, Any]) -> list[str]:
    return sorted({ref.split(":")[0] for p in spec["protocols"] for ref in all_refs(p)})


def _cell(fill: Callable[[str], list[dict[str, Any]]], ref: str, key: str) -> dict[str, Any]:
    table, row = ref.split(":")
    match = [r for r in fill(table) if r.get("experiment") == row]
    if not match:
        raise ValueError(f"{ref}: table {table} has no row recorded as {row!r}")
    return match[0]["cells"][key]


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
        todo = [rid for ref in all_refs(proto) for rid in _cell(fill, ref, key).get("run_ids") or []]
        while todo:
            run = ledger.get(todo.pop())
            if run is None or run["run_id"] in seen:
                continue
            seen[run["run_id"]] = _seconds(run)
            start = ledger.start_of(run)
            if start:
                todo.append(start)
        names = {ref.split(":")[1] for ref in all_refs(proto)}
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
        cells = {ref: _cell(fill, ref, key) for ref in all_refs(proto)}
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


#: A run id's start (:func:`start_of_run`): the run whose weights it loaded, its weights file, or
#: ``None`` for a run trained from nothing.
StartOf = Callable[[str], Any]


class Unresolved(str):
    """A start ``run:<experiment>`` that the ledger cannot resolve (no completed train run of that
    experiment had finished when the run started): which run it was is unknown, so every run that
    names it shares one start, and the claim cell says so."""


def start_of_run(ledger: Any) -> StartOf:
    """The start of a run of ``ledger`` (a :class:`vitexp.ledger.Ledger`): ``run:<id>`` of the run
    whose weights it loaded (``run:<name>`` resolved as the run resolved it; :class:`Unresolved` where
    the ledger cannot), else its ``backbone.pretrained`` (a weights tag or file: one start), else
    ``None``."""

    def start(run_id: str) -> Any:
        run = ledger.get(run_id)
        if run is None:
            return None
        loaded = ledger.start_of(run)
        if loaded:
            return f"run:{loaded}"
        pretrained = ((run.get("config") or {}).get("backbone") or {}).get("pretrained") or None
        if isinstance(pretrained, str) and pretrained.startswith("run:"):
            return Unresolved(pretrained)
        return pretrained

    return start


def _by_start(cells: list[dict[str, Any]], start_of: StartOf | None) -> tuple[dict, dict]:
    """A role's cells (one per reference) as ({start: {seed: value}}, {start: marks}): a seed of a run
    trained from nothing is its own start; without ``start_of`` (or run ids) the i-th reference of
    every role is one start."""
    values: dict[Any, dict[Any, float]] = {}
    marks: dict[Any, str] = {}
    for i, cell in enumerate(cells):
        seeds = cell.get("seeds") or {}
        ids = cell.get("run_ids") or []
        for j, (seed, value) in enumerate(sorted(seeds.items())):
            if start_of is None or len(ids) != len(seeds):
                key: Any = ("ref", i)
            else:
                loaded = start_of(ids[j])
                key = ("seed", seed) if loaded is None else ("start", loaded)
            if seed in values.setdefault(key, {}):
                raise ValueError(
                    f"two rows of one role give seed {seed} from the same start {key[1]!r}: list one row per"
                    " start (docs/verdicts.md)"
                )
            values[key][seed] = value
            marks[key] = marks.get(key, "") + (cell.get("marks") or "")
    return values, marks


def _pairs(
    a: list[dict[str, Any]],
    b: list[dict[str, Any]],
    digits: int,
    needed: tuple[int, int],
    start_of: StartOf | None,
) -> dict[str, Any]:
    """The paired difference a − b of a role's cells against another's, paired by start and seed
    (docs/verdicts.md): its text (marks carried), pairs by start, statistics across starts and sign;
    ``needed``: (starts, pairs per start)."""
    (ga, ma), (gb, mb) = _by_start(a, start_of), _by_start(b, start_of)
    groups = {}
    for key in sorted(ga.keys() & gb.keys(), key=str):
        common = sorted(set(ga[key]) & set(gb[key]))
        if common:
            groups[key] = [ga[key][s] - gb[key][s] for s in common]
    pairs = [p for g in groups.values() for p in g]
    own = bool(groups) and all(k[0] == "seed" for k in groups)
    stats = rule.across_starts(groups)
    marked = "".join(sorted(set("".join(ma.get(k, "") + mb.get(k, "") for k in groups))))
    flat = summarize(pairs)
    if len(groups) <= 1 or own:
        text = format_stat(flat["mean"], flat["std"], flat["n"], digits, signed=True) or "not run"
        if own and len(groups) > 1:
            text = text.replace(f"({flat['n']})", f"({flat['n']} starts, a seed each)")
        elif groups and next(iter(groups))[0] == "start":  # fine-tuned from one start: its seeds share it
            text = text.replace(f"({flat['n']})", f"({flat['n']}, one start)")
    else:
        means = ", ".join(f"{m:+.{digits}f}" for m in stats["means"])
        within = f", ± {stats['within']:.{digits}f} within" if stats["within"] is not None else ""
        text = (
            f"{stats['mean']:+.{digits}f} ± {stats['std']:.{digits}f} across {stats['starts']} starts"
            f" ({means}{within}; {len(pairs)} pairs)"
        )
    text += f" {marked}" if marked else ""
    unresolved = sorted({k[1] for k in groups if isinstance(k[1], Unresolved)})
    if unresolved:
        text += f" (start {', '.join(unresolved)} not found in the ledger: its runs counted as one start)"
    ok = rule.complete(groups, needed[0], needed[1], own)
    sign = rule.NOT_RUN if not pairs else rule.sign(pairs) if ok else rule.INCOMPLETE
    mean_, std_ = (flat["mean"], flat["std"]) if len(groups) <= 1 or own else (stats["mean"], stats["std"])
    return {
        "n": len(pairs),
        "mean": mean_,
        "std": std_,
        "text": text,
        "pairs": pairs,
        "groups": groups,
        "stats": stats,
        "own_starts": own,
        "marks": marked,
        "sign": sign,
    }


def _roles(fill: Callable, proto: dict[str, Any], claim: dict[str, Any], column: str) -> tuple[list, list]:
    """The cells of a claim's two roles (a, b) under a protocol, in one column."""
    a, b = ([_cell(fill, ref, column) for ref in refs(proto, claim[r])] for r in ("a", "b"))
    return a, b


def evaluate(
    spec: dict[str, Any], fill: Callable[[str], list[dict[str, Any]]], start_of: StartOf | None = None
) -> list[dict[str, Any]]:
    """Each claim with its cell per protocol (``text``, ``sign``, the difference's stats) and verdict;
    ``fill(table)`` gives a table's filled rows (:func:`vitexp.report.tables.fill`), ``start_of`` a
    run's start (:func:`start_of_run`; without it, the i-th row of every role is one start)."""
    filled = {t: fill(t) for t in tables_of(spec)}
    fill = filled.__getitem__
    digits, noun = int(spec.get("digits", 2)), spec.get("column", "protocol")
    val_key = spec.get("val_key")
    out = []
    for claim in spec["claims"]:
        key = claim.get("key", spec.get("key", "top1"))
        cells = []
        for proto in spec["protocols"]:
            if claim["a"] not in proto["rows"] or claim["b"] not in proto["rows"]:
                cells.append({"protocol": proto["label"], "text": "not in this protocol", "sign": None})
                continue
            need = (
                int(proto.get("starts", spec.get("starts", 1))),
                int(proto.get("pairs", spec.get("pairs", 1))),
            )

            test, val = (
                _pairs(*_roles(fill, proto, claim, column), digits, need, start_of) if column else None
                for column in (key, val_key)
            )
            sign_ = rule.both(test["sign"], val and val["sign"])
            shown = rule.directed(sign_, test["sign"], val and val["sign"])
            interim = (
                rule.both(rule.sign(test["pairs"]), val and rule.sign(val["pairs"]))
                if sign_ == rule.INCOMPLETE
                else None
            )
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
                    "shown": shown,
                    "needed": need[1],
                    "needed_starts": need[0],
                    "interim": interim,
                    "marks": test["marks"],
                    "n": test["n"],
                    "mean": test["mean"],
                    "std": test["std"],
                    "starts": test["stats"]["starts"],
                    "own_starts": test["own_starts"],
                    "stats": test["stats"],
                    "val": val
                    and {k: val[k] for k in ("n", "mean", "std", "sign", "stats", "own_starts")}
                    | {"starts": val["stats"]["starts"]},
                    "reference": bool(proto.get("reference")),
                }
            )
        voting = [c for c in cells if not c.get("reference")]
        judged = [(c["protocol"], c["shown"]) for c in voting if c["sign"] is not None]
        pending = [f"{c['protocol']}: {c['text']}" for c in voting if c["sign"] == rule.INCOMPLETE]
        leaning = [
            f"{c['protocol']} ({c['marks']})"
            for c in voting
            if c.get("marks") and c["sign"] not in (None, rule.NOT_RUN, rule.INCOMPLETE)
        ]
        text = (
            rule.verdict(judged, noun)
            + (f"; not yet judged: {'; '.join(pending)}" if pending else "")
            + (f"; rests on marked runs under {', '.join(leaning)}" if leaning else "")
        )
        out.append({"claim": claim["label"], "cells": cells, "verdict": text})
    return out


def _count(cell: dict[str, Any]) -> str:
    """An incomplete cell's starts (a protocol that needs more than one), else its pairs: per split where
    the splits have different numbers (validation not run while the test split is complete), else one
    count."""
    val = cell.get("val")
    if cell.get("needed_starts", 1) > 1 and not cell.get("own_starts"):
        both_ = (
            f"{cell['starts']}"
            if not val or val["starts"] == cell["starts"]
            else (f"test {cell['starts']}, val {val['starts']}")
        )
        return f"{both_} of {cell['needed_starts']} starts, {cell['needed']} pairs each"
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
                    else f"{x['text']} ({x.get('shown', x['sign'])}"
                    + ("; not counted)" if x.get("reference") else ")")
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
        "seeds both rows completed from the same start, mean ± sample std (n pairs); where a protocol has "
        "several starts, the mean and std across the starts' means (degrees of freedom: starts − 1), each "
        "start's mean, and the pooled std of the pairs within a start. "
        + rule.legend(bool(splits), True, noun)
        + f" A verdict is given only where the measured {noun}s agree."
        + (
            f" A cell with fewer starts or pairs than its {noun} needs is incomplete: it is shown with its"
            " sign so far, not judged, and counts as not measured."
            if spec.get("pairs", 1) > 1 or spec.get("starts", 1) > 1
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
        + ", ".join(f"{role} = " + ", ".join(f"`{ref}`" for ref in refs(p, role)) for role in p["rows"])
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
    claims, costs = evaluate(spec, fill_once, start_of_run(ledger)), cost(spec, fill_once, ledger)
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
