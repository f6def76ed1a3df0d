"""A method's claims under several protocols: one generated table per ``sweeps/verdicts/<name>.yaml``.

A verdict file names protocols (each maps roles such as ``full``, ``bspf``, ``tome`` to a row of a
table spec: ``<table>:<row name>``) and claims (``a`` beats ``b`` on ``key``: the file's, or the
claim's own ``key``, so one file can judge several columns). Each cell is the paired difference
``a - b`` over the seeds both rows completed (:func:`vitexp.aggregate.paired_difference`), mean ±
sample std (n pairs), read from the same ledger and the same filled rows as the tables. A file
whose columns are not protocols (the same protocol on several backbones) names them with
``column: backbone``: the verdicts then say "under every measured backbone".

Decisions:
- A protocol *supports* a claim when every pair is above zero, *contradicts* it when every pair is
  below, and is *undecided* otherwise (pairs of both signs, or a single pair of 0); with three seeds
  that is the sign test's strongest answer, stated without a p-value. A cell with fewer pairs than
  the verdict file's ``pairs`` (the seeds each row is to have; 1 when not given) is *incomplete*: its
  difference is shown, its sign is not, and it counts as not measured (a protocol whose runs are
  under way says nothing until they are done).
- A claim's verdict is given only where the measured protocols agree ("holds under all N measured
  protocols", "fails under all N"); where they disagree the verdict names which protocol says what;
  protocols not run or incomplete are counted ("k of M protocols measured, j incomplete") and the
  verdict says "so far", so it never speaks for them; an incomplete cell's difference follows the
  verdict ("not yet judged: ..."), whichever way it points.
- A cell carries the marks of the two table cells it pairs (:mod:`vitexp.ledger.marks`: ‡ a run whose
  code cannot be rebuilt, § a protocol today's code does not reproduce), and a verdict that rests on
  a marked cell names the protocols where it does, so a claim never leans on such a run unsaid.
- A protocol's cost is the training time of every run its cells use plus the runs whose weights
  those loaded (``backbone.pretrained=run:``, followed back to a run that loaded none), each counted
  once: the ledger's ``fit_time_s`` (training only, test excluded) summed and shown in hours, on the
  one CPU thread each run had.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from vitexp import PROJECT_ROOT
from vitexp.aggregate import format_stat, paired_difference

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
                raise ValueError(f"{name}: protocol {proto['label']!r}, role {role!r}: {ref!r} is not <table>:<row name>")
    roles = {r for p in spec["protocols"] for r in p["rows"]}
    for claim in spec["claims"]:
        unknown = {claim["a"], claim["b"]} - roles
        if unknown:
            raise ValueError(f"{name}: claim {claim['label']!r} names roles {sorted(unknown)}; roles: {sorted(roles)}")
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


def verdict(signs: list[tuple[str, str]], noun: str = "protocol") -> str:
    """One claim's verdict from ``(column label, sign)`` pairs (module docstring); ``noun``: what a
    column is (``protocol``, ``backbone``)."""
    measured = [(p, s) for p, s in signs if s not in ("not run", "incomplete")]
    incomplete = sum(s == "incomplete" for _, s in signs)
    of = f"{len(measured)} of {len(signs)} {noun}s measured" + (f", {incomplete} incomplete" if incomplete else "")
    if not measured:
        return f"not run ({of})"
    so_far = " so far" if len(measured) < len(signs) else ""  # a column still to come may disagree
    kinds = {s for _, s in measured}
    if kinds == {"supports"}:
        return f"holds under every measured {noun}{so_far} ({of})"
    if kinds == {"contradicts"}:
        return f"fails under every measured {noun}{so_far} ({of})"
    if kinds == {"undecided"}:
        return f"undecided under every measured {noun}{so_far} ({of})"
    parts = [f"{s} under {', '.join(p for p, k in measured if k == s)}" for s in ("supports", "contradicts", "undecided")
             if s in kinds]
    return f"{noun}s disagree: {'; '.join(parts)} ({of})"


def cost(spec: dict[str, Any], fill: Callable[[str], list[dict[str, Any]]], ledger: Any) -> list[dict[str, Any]]:
    """Per protocol: ``runs`` (the cells' runs and their starts, each once), ``fit_s`` (each run's
    ``fit_time_s``) and ``hours`` (their sum; module docstring); ``ledger`` is a :class:`vitexp.ledger.Ledger`."""
    key, out = spec.get("key", "top1"), []
    for proto in spec["protocols"]:
        seen: dict[str, float] = {}
        todo = [rid for ref in proto["rows"].values() for rid in _cell(fill, ref, key).get("run_ids") or []]
        while todo:
            run = ledger.get(todo.pop())
            if run is None or run["run_id"] in seen:
                continue
            seen[run["run_id"]] = float((run.get("metrics") or {}).get("fit_time_s") or 0.0)
            start = ledger.start_of(run)
            if start:
                todo.append(start)
        out.append({"protocol": proto["label"], "runs": sorted(seen), "fit_s": seen, "hours": sum(seen.values()) / 3600})
    return out


def evaluate(spec: dict[str, Any], fill: Callable[[str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each claim with its cell per protocol (``text``, ``sign``, the difference's stats) and verdict;
    ``fill(table)`` gives a table's filled rows (:func:`vitexp.tables.fill`)."""
    filled = {t: fill(t) for t in tables_of(spec)}
    fill = filled.__getitem__
    digits, needed, noun = int(spec.get("digits", 2)), int(spec.get("pairs", 1)), spec.get("column", "protocol")
    out = []
    for claim in spec["claims"]:
        key = claim.get("key", spec.get("key", "top1"))
        cells = []
        for proto in spec["protocols"]:
            rows = proto["rows"]
            if claim["a"] not in rows or claim["b"] not in rows:
                cells.append({"protocol": proto["label"], "text": "not in this protocol", "sign": None})
                continue
            pair = [_cell(fill, rows[claim[role]], key) for role in ("a", "b")]
            a, b = (c.get("seeds") or {} for c in pair)
            diff = paired_difference(a, b)
            pairs = [a[s] - b[s] for s in diff["seeds"]]
            marked = "".join(sorted(set("".join(c.get("marks") or "" for c in pair)))) if diff["n"] else ""
            text = (format_stat(diff["mean"], diff["std"], diff["n"], digits, signed=True) or "not run") + \
                (f" {marked}" if marked else "")
            cells.append({"protocol": proto["label"], "text": text, "sign": sign(pairs, needed), "needed": needed,
                          "marks": marked, **diff})
        judged = [(c["protocol"], c["sign"]) for c in cells if c["sign"] is not None]
        pending = [f"{c['protocol']}: {c['text']}" for c in cells if c["sign"] == "incomplete"]
        leaning = [f"{c['protocol']} ({c['marks']})" for c in cells
                   if c.get("marks") and c["sign"] in ("supports", "contradicts", "undecided")]
        text = verdict(judged, noun) + (f"; not yet judged: {'; '.join(pending)}" if pending else "") + \
            (f"; rests on marked runs under {', '.join(leaning)}" if leaning else "")
        out.append({"claim": claim["label"], "cells": cells, "verdict": text})
    return out


def render(spec: dict[str, Any], claims: list[dict[str, Any]], costs: list[dict[str, Any]] | None = None) -> str:
    """The markdown table: a row per claim, a column per protocol, then the verdict; with ``costs``
    (:func:`cost`) a last row of training hours per protocol."""
    head = ["Claim (a − b)"] + [p["label"] for p in spec["protocols"]] + ["Verdict"]
    lines = [f"# {spec['title']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in claims:
        cells = [x["text"] if x["sign"] in (None, "not run") else
                 f"{x['text']} (incomplete: {x['n']} of {x['needed']} pairs)" if x["sign"] == "incomplete" else
                 f"{x['text']} ({x['sign']})" for x in c["cells"]]
        lines.append("| " + " | ".join([c["claim"]] + cells + [c["verdict"]]) + " |")
    if costs is not None:
        hours = [f"{c['hours']:.2f} h ({len(c['runs'])} run{'s' if len(c['runs']) > 1 else ''})" if c["runs"] else "not run" for c in costs]
        every = {rid: sec for c in costs for rid, sec in c["fit_s"].items()}  # a run in two protocols once
        lines.append("| Cost: training time, CPU-hours (one thread per run) | " + " | ".join(hours) + " | "
                     f"{sum(every.values()) / 3600:.2f} h in all ({len(every)} runs) |")
    noun = spec.get("column", "protocol")
    lines += ["", "Cells: the paired difference of " + spec.get("unit", "top-1 (%)") + ", a − b, over the seeds "
              "both rows completed, mean ± sample std (n pairs). supports: every pair above 0; contradicts: every "
              "pair below 0; undecided: pairs of both signs (vitexp/protocols.py). A verdict is given only where "
              f"the measured {noun}s agree." + (f" A cell with fewer than {spec['pairs']} pairs is incomplete: "
              "it is shown but not judged, and counts as not measured." if spec.get("pairs", 1) > 1 else "")]
    if any(x.get("marks") for c in claims for x in c["cells"]):
        lines += ["", "A mark after a cell is carried over from a table cell it pairs (‡: a run trained from a dirty "
                  "tree whose code cannot be rebuilt; §: a protocol today's code does not reproduce): that table's "
                  "notes say which runs."]
    if costs is not None:
        lines += ["", "Cost: the ledger's fit_time_s (training, test excluded) summed over the runs in the cells and "
                  "the runs whose weights they loaded (a shared start counted once), in hours; in all, a run that two "
                  f"{noun}s share counted once."]
    lines += ["", f"{noun.capitalize()}s (rows from the tables named):", ""]
    lines += [f"- **{p['label']}**: " + ", ".join(f"{role} = `{ref}`" for role, ref in p["rows"].items())
              for p in spec["protocols"]]
    lines += [f"- {n}" for n in spec.get("notes") or []]
    return "\n".join(lines) + "\n"


def text(name: str, fill: Callable[[str], list[dict[str, Any]]], ledger: Any) -> str:
    """The markdown of verdict file ``name`` (:func:`render` with its cost row from ``ledger``)."""
    spec = load(name)
    return render(spec, evaluate(spec, fill), cost(spec, fill, ledger))


def write(names: Iterable[str], text_of: Callable[[str], str], out_dir: Path,
          writer: Callable[[Path, str], Any]) -> dict[str, dict[str, str]]:
    """Write ``<out_dir>/<name>.md`` for each verdict file, its markdown from ``text_of(name)``
    (:func:`text`); ``{name: {"md": path}}``."""
    written = {}
    for name in names:
        path = Path(out_dir) / f"{name}.md"
        writer(path, text_of(name))
        written[name] = {"md": str(path)}
    return written
