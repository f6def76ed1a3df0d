"""Table specs (``sweeps/<table>.yaml``) joined with the ledger -> Markdown, LaTeX, CSV and a
cost-vs-accuracy plot (:mod:`vitexp.plots`) in ``results/tables/``.

A cell shows vitexp's value from the newest completed run recorded under the row's name
(:func:`vitexp.rows.row_name`) that has that metric, beside the paper's value. With no such run the cell says "not run" (or "running" /
"interrupted" while the row's newest run is one, :func:`vitexp.results.effective_status`), or, in a column
marked ``optional: true``, "n/a" when the row has a completed training run that does not record that
metric (the soft-gated accuracy of an unpruned row); a row marked
``cited: true`` (a published baseline vitexp does not reimplement) says "cited, not run". No
number ever comes from anywhere but a run or the spec's paper value.

Spec keys: ``title``; ``columns`` (``key``, ``label``, ``unit``, ``digits``, ``paired``, ``optional``); ``plot``
(``x``, ``y`` metric keys, optional); ``seeds`` (optional); ``rows`` (``label``, ``experiment``,
``overrides``, ``name``, ``grid`` (:mod:`vitexp.rows`: a row is a base experiment plus overrides,
recorded under its name; a grid expands into rows), ``run``: train | flops | bench, ``cited``,
``seeds``, ``baseline`` (the name of the baseline row), ``series`` (rows of one sweep, drawn as a
curve), ``family`` / ``backbone`` / ``dataset`` (the plot's colour, marker and axis where the row
has no experiment to read them from), ``panel`` (the plot axis of rows whose accuracies are not
comparable with the others', :func:`vitexp.plots.axis_panels`), ``paper``: {metric: {value, source, derived, formula}});
``notes`` (optional list of footnotes printed under the table, e.g. where a row's settings were
fitted rather than read); ``protocol`` (optional, the spec's or a row's: only runs whose ledger
``protocol`` has these values fill it, e.g. ``{mode: compare}`` for one interleaved comparison).

Provenance (:mod:`vitexp.provenance`): every paper value names the document and place it was read
from (``source``). A value the paper does not print but that follows by arithmetic from what it
prints (72.2 + 1.3 = 73.5) carries ``derived: true`` and its ``formula``; the formula must evaluate
to the value, and such a cell is rendered with :data:`DERIVED_MARK` and a footnote giving the
formula. :func:`load_spec` refuses a spec that breaks these rules (:mod:`vitexp.provenance`).

Seeds (:mod:`vitexp.aggregate`): a row with seeds shows mean ± sample std (n) over its seeds' newest
runs, says when fewer seeds completed than it asks for, and, with a ``baseline`` row, the paired
difference to it (a "Δ ... vs baseline" column for each ``paired: true`` column); plots draw the std
as error bars.
"""
from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

from vitexp import SWEEPS_DIR, aggregate
from vitexp.errors import one_line
from vitexp.logging_utils import log_tables
from vitexp.plots import render_plot, series_curves  # noqa: F401 (series_curves: the tables' API too)
from vitexp.provenance import DERIVED_MARK, provenance_errors
from vitexp.rows import check_rows, expand_rows, row_name
from vitexp.results import atomic_write, default_results_dir, effective_status, iter_runs
from vitexp.run import ArgumentParser

NOT_RUN = "not run"
NOT_RECORDED = "n/a"
CITED = "cited, not run"
NO_PAPER = "—"


def load_spec(table: str | Path) -> dict[str, Any]:
    """A table spec by name (``sweeps/<name>.yaml``) or path; a clear error lists valid names."""
    path = Path(table)
    if not path.suffix:
        path = SWEEPS_DIR / f"{table}.yaml"
    if not path.is_file():
        valid = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"table spec {path} not found; valid tables: {valid}")
    spec = yaml.safe_load(path.read_text())
    spec["name"] = path.stem
    for key in ("title", "columns", "rows"):
        if key not in spec:
            raise ValueError(f"{path}: missing key {key!r}")
    spec["rows"] = expand_rows(spec["rows"])
    check_rows(spec["rows"], str(path))
    for row in spec["rows"]:
        if not row.get("cited") and not row.get("experiment"):
            raise ValueError(f"{path}: row {row.get('label')!r} has neither an experiment nor cited: true")
        aggregate.row_seeds(spec, row)  # a malformed seeds list fails here
    problems = provenance_errors(spec)
    if problems:
        raise ValueError(f"{path}: paper values without provenance: " + "; ".join(problems))
    return spec


def all_specs() -> list[str]:
    return sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))


def wandb_runs(path: str) -> list[dict[str, Any]]:
    """Runs of a W&B project (``ENTITY/PROJECT``) as ledger-like records."""
    import wandb

    records = []
    for run in wandb.Api().runs(path):
        config = dict(run.config)
        summary = {k: v for k, v in dict(run.summary).items() if not k.startswith("_")}
        records.append({
            "run_id": run.id,
            "experiment": config.get("name", run.name),
            "status": {"finished": "completed", "crashed": "failed", "failed": "failed"}.get(run.state, run.state),
            "kind": getattr(run, "job_type", None) or "train",
            "config": config,  # its seed places the run in a seeded row
            "metrics": summary,
            "started": str(getattr(run, "created_at", "")),
            "wandb_url": getattr(run, "url", None),
        })
    return sorted(records, key=lambda r: r["started"])


def fill(spec: dict[str, Any], runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every row and column: vitexp's value (newest completed run with that metric), its
    run id, the paper's value and source."""
    runs = list(runs)
    # an eval entry re-tests a training run's weights under its name (vitexp-eval): it checks a cell, never fills one
    completed = [r for r in runs if r.get("status") == "completed" and r.get("kind") != "eval"]
    starts = {row_name(r): next((x["run_id"] for x in reversed(completed) if x.get("kind") == "train"
                                 and x.get("experiment") == row_name(r)), None)
              for r in expand_rows(spec["rows"]) if r.get("experiment") and aggregate.shared_start(spec, r)}
    filled = []
    for row in expand_rows(spec["rows"]):
        name = row_name(row)
        wanted = row.get("protocol") or spec.get("protocol") or {}  # e.g. {mode: compare}: only such runs
        mine = [r for r in completed if name and r.get("experiment") == name
                and all((r.get("protocol") or {}).get(k) == v for k, v in wanted.items())]
        seeds = aggregate.row_seeds(spec, row) if name else None
        by_seed = aggregate.seed_runs(completed, name, seeds) if seeds is not None else None
        pending = [effective_status(r) for r in runs if name and r.get("experiment") == name
                   and r.get("status") == "running"]
        cells = {}
        for col in spec["columns"]:
            key = col["key"]
            paper = (row.get("paper") or {}).get(key) or {}
            if by_seed is not None:
                cells[key] = {**aggregate.seeded_cell(by_seed, key), "paper": paper.get("value"),
                              "source": paper.get("source"),
                              "formula": paper.get("formula") if paper.get("derived") else None}
                continue
            value, run_id = None, None
            for r in mine:  # oldest first: the newest run wins
                v = (r.get("metrics") or {}).get(key)
                if v is not None:
                    value, run_id = v, r["run_id"]
            cells[key] = {"value": value, "run_id": run_id, "paper": paper.get("value"),
                          "source": paper.get("source"), "formula": paper.get("formula") if paper.get("derived") else None}
        cited_ids = {i for c in cells.values() for i in c.get("run_ids") or ()}  # a seeded row's cited runs
        cited = [r for rs in (by_seed or {}).values() for r in rs if r["run_id"] in cited_ids]
        filled.append({"label": row["label"], "experiment": name,
                       "cited": bool(row.get("cited")), "series": row.get("series"), "cells": cells,
                       "seeds": seeds, "baseline": row.get("baseline"),
                       "overlapping": sorted({r["run_id"] for r in cited if aggregate.overlapping_order(r)}),
                       "other_start": sorted({r["run_id"] for r in cited if aggregate.other_start(r, starts, completed)}),
                       "pending": pending[-1] if pending else None,
                       "trained": any(r.get("kind") == "train" for r in
                                      (mine if by_seed is None else [r for rs in by_seed.values() for r in rs]))})
    aggregate.paired_cells(spec, filled)
    return filled


def _fmt(value: Any, digits: int) -> str:
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    if isinstance(value, (list, tuple)):  # a per-layer metric
        return " / ".join(_fmt(v, digits) for v in value)
    return str(value)


def _cell_texts(row: dict[str, Any], col: dict[str, Any]) -> tuple[str, str]:
    cell = row["cells"][col["key"]]
    digits = int(col.get("digits", 2))
    if "n" in cell:  # a seeded row: mean ± std (n)
        ours = aggregate.format_stat(cell["value"], cell["std"], cell["n"], digits, cell["expected"]) or _missing(row, col)
    elif cell["value"] is not None:
        ours = _fmt(cell["value"], digits)
    else:
        ours = _missing(row, col)
    return ours, _paper_text(cell)


def _missing(row: dict[str, Any], col: dict[str, Any]) -> str:
    """The text of a cell without a value: cited, running/interrupted, n/a (an optional metric the
    row's training does not record), not run."""
    if row["cited"]:
        return CITED
    return row.get("pending") or (NOT_RECORDED if col.get("optional") and row.get("trained") else NOT_RUN)


def _paper_text(cell: dict[str, Any]) -> str:
    """The paper's value as printed in a table, with :data:`DERIVED_MARK` when it is derived."""
    paper = f"{cell['paper']:g}" if isinstance(cell["paper"], (int, float)) else (cell["paper"] or NO_PAPER)
    return paper + DERIVED_MARK if cell.get("formula") else paper


def footnotes(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The table's footnotes: one per derived paper value (its formula and source), then the spec's notes."""
    notes = [f"{DERIVED_MARK} {row['label']}, {col['label']}: {_paper_text(c)[:-1]} = {c['formula']}, obtained by "
             f"arithmetic from {c['source']}."
             for row in rows for col in spec["columns"] for c in [row["cells"][col["key"]]] if c.get("formula")]
    notes += [str(n) for n in spec.get("notes") or []]
    name = spec.get("name", "TABLE")
    overlapping = {i for r in rows for i in r.get("overlapping") or ()}
    if overlapping:
        notes.append(f"{len(overlapping)} of the seeded runs (seeds 1 and up, no data_order in their protocol) drew "
                     "epoch e's order from seed + e, so each repeated an epoch of the next seed: their seeds are not "
                     f"independent and a std may be too small; vitexp-sweep {name} trains them again.")
    other = {i for r in rows for i in r.get("other_start") or ()}
    if other:
        notes.append(f"{len(other)} of the seeded runs fine-tuned another run of their shared start than the one "
                     f"this table shows, so they measure other weights; vitexp-sweep {name} trains them again.")
    return notes


def _header(spec) -> list[str]:
    head = ["Row"]
    for col in spec["columns"]:
        unit = f" ({col['unit']})" if col.get("unit") and len(col["unit"]) <= 12 else ""
        head += [f"{col['label']}{unit} vitexp", f"{col['label']}{unit} paper"]
    head += [f"Δ {col['label']} vs baseline" for col in aggregate.paired_columns(spec)]
    return head


def _body(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[list[str]]:
    """One list of cell texts per row: the label, vitexp's and the paper's value per column, then
    the paired differences to the baseline."""
    paired = aggregate.paired_columns(spec)
    return [[row["label"], *(t for col in spec["columns"] for t in _cell_texts(row, col)),
             *(aggregate.paired_text(row, col) for col in paired)] for row in rows]


def render_markdown(spec: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The table by ``tabulate`` (GitHub Markdown), then units, the paper values' sources, footnotes and the runs."""
    from tabulate import tabulate

    table = tabulate(_body(spec, rows), headers=_header(spec), tablefmt="github", disable_numparse=True)
    lines = [f"# {spec['title']}", "", table]
    lines += ["", "Units: " + "; ".join(f"{c['label']}: {c.get('unit', '')}" for c in spec["columns"]) + "."]
    sources = sorted({(c["source"]) for r in rows for c in r["cells"].values() if c["source"]})
    if sources:
        lines += ["", "Paper values: " + "; ".join(sources) + "."]
    notes = footnotes(spec, rows)
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    if any(r["seeds"] is not None for r in rows):
        lines += ["", "Seeded rows: mean ± sample std (n seeds) over the seeds of the method's fine-tuning; "
                  "Δ: the paired difference to the row's baseline over the seeds both completed, mean ± std (n pairs)."]
    again = sorted({i for r in rows for key in ("overlapping", "other_start") for i in r.get(key) or ()})
    if again:
        lines += ["", "Runs to train again (see the notes): " + ", ".join(f"`{i}`" for i in again) + "."]
    run_ids = sorted({i for r in rows for c in r["cells"].values() for i in (c.get("run_ids") or [c["run_id"]]) if i})
    if run_ids:
        lines += ["", "vitexp runs (results/runs/): " + ", ".join(f"`{i}`" for i in run_ids) + "."]
    return "\n".join(lines) + "\n"


#: Symbols the tables print, as LaTeX (after tabulate's own escaping).
UNICODE_TEX = (("—", "---"), ("×", r"$\times$"), ("±", r"$\pm$"), ("Δ", r"$\Delta$"), ("†", r"\textsuperscript{\dag}"))


def _tex_escape(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                 ("—", "---"), ("×", r"$\times$"), ("±", r"$\pm$"), ("Δ", r"$\Delta$"),
                 (DERIVED_MARK, r"\textsuperscript{\dag}")):
        text = text.replace(a, b)
    return text


def render_latex(spec: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A booktabs ``tabular`` by ``tabulate`` (which escapes the cells) in a captioned table, then footnotes."""
    from tabulate import tabulate

    head = _header(spec)
    tabular = tabulate(_body(spec, rows), headers=head, tablefmt="latex_booktabs", disable_numparse=True,
                       colalign=("left",) + ("right",) * (len(head) - 1))
    for a, b in UNICODE_TEX:  # tabulate escapes LaTeX's specials; these symbols it leaves as they are
        tabular = tabular.replace(a, b)
    units = "; ".join(f"{c['label']}: {c.get('unit', '')}" for c in spec["columns"])
    notes = [r"\par\footnotesize " + _tex_escape(n) for n in footnotes(spec, rows)]
    return "\n".join([r"\begin{table}[t]", r"\centering", rf"\caption{{{_tex_escape(spec['title'])}}}", tabular,
                      *notes, f"% {len(head)} columns; units: {_tex_escape(units)}", r"\end{table}"]) + "\n"


def render_csv(spec: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    head = ["row", "experiment"]
    for col in spec["columns"]:
        k = col["key"]
        head += [k, f"{k}_paper", f"{k}_paper_source", f"{k}_paper_formula", f"{k}_run_id"]
    head += aggregate.csv_header(spec)
    writer.writerow(head)
    for row in rows:
        line = [row["label"], row["experiment"] or ""]
        for col in spec["columns"]:
            c = row["cells"][col["key"]]
            ours = c["value"] if c["value"] is not None else _missing(row, col)
            line += [ours, "" if c["paper"] is None else c["paper"], c["source"] or "", c.get("formula") or "",
                     c["run_id"] or ""]
        line += aggregate.csv_cells(spec, row)
        writer.writerow(line)
    return buf.getvalue()


def write_table(spec: dict[str, Any], runs: list[dict[str, Any]], out_dir: Path) -> dict[str, str]:
    """Write <name>.md/.tex/.csv/.png (each through :func:`vitexp.results.atomic_write`)."""
    rows = fill(spec, runs)
    written = {}
    for ext, text in (("md", render_markdown(spec, rows)), ("tex", render_latex(spec, rows)),
                      ("csv", render_csv(spec, rows))):
        written[ext] = str(atomic_write(out_dir / f"{spec['name']}.{ext}", text))
    if spec.get("plot"):
        written["png"] = str(atomic_write(out_dir / f"{spec['name']}.png",
                                          lambda tmp: render_plot(spec, rows, Path(tmp), footnotes(spec, rows))))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="vitexp-tables",
        description="Join the ledger with the table specs in sweeps/ and write results/tables/<table>.{md,tex,csv,png}.",
    )
    parser.add_argument("tables", nargs="*", help=f"table names (default: all of {all_specs()})")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT",
                        help="read runs through wandb.Api() instead of the ledger (and log the tables there)")
    parser.add_argument("--log-wandb", metavar="[ENTITY/]PROJECT", nargs="?", const="",
                        help="log each table (wandb.Table) and its plot to W&B: to PROJECT, else --wandb's, else the "
                             "project runs log to (conf/logger/wandb.yaml); offline unless logged in (wandb sync uploads it)")
    parser.add_argument("--results-dir", type=Path, default=None, help="ledger root (default: $VITEXP_RESULTS or results/)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: <results-dir>/tables)")
    args = parser.parse_args(argv)
    results_dir = args.results_dir or default_results_dir()
    out_dir = args.out or results_dir / "tables"
    try:
        specs = [load_spec(t) for t in (args.tables or all_specs())]
    except (FileNotFoundError, ValueError) as err:
        print(f"vitexp-tables: invalid: {one_line(err)}", file=sys.stderr)
        print(json.dumps({"status": "invalid", "error": one_line(err), "ledger": None}))
        return 2
    try:
        runs = wandb_runs(args.wandb) if args.wandb else list(iter_runs(results_dir))
    except Exception as err:  # no W&B login, no network, no such project
        print(f"vitexp-tables: failed: reading W&B runs of {args.wandb}: {one_line(err)}", file=sys.stderr)
        print(json.dumps({"status": "failed", "error": f"W&B {args.wandb}: {type(err).__name__}: {one_line(err)}"}))
        return 1
    written = {}
    for spec in specs:
        written[spec["name"]] = write_table(spec, runs, out_dir)
        print(render_markdown(spec, fill(spec, runs)))
    logs = args.log_wandb is not None or bool(args.wandb)
    url = log_tables(written, args.log_wandb or args.wandb, results_dir) if logs else None
    print(json.dumps({"status": "completed", "tables": written, "runs_read": len(runs),
                      "source": args.wandb or str(results_dir / "runs"), "wandb": url}))
    return 0
