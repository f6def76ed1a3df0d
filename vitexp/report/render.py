"""Filled table rows (:func:`vitexp.report.tables.fill`) as text: GitHub Markdown and a booktabs LaTeX
table (both by ``tabulate``), a CSV, and the footnotes they share.

A cell shows vitexp's value (a seeded row: mean ± std (n)) followed by its marks
(:mod:`vitexp.ledger.marks`: § stale protocol, ‡ dirty tree without its diff, ≈ throughput timed on a
busy machine), each explained once in the notes; a cell without a value says why ("not run",
"running"/"interrupted", "n/a" for an optional metric its trained row does not record, "cited,
not run"); a cell that only repeats another column by construction says so (a column's
``same_as``: :func:`_same_as`). The CSV keeps numbers only (the marks are in the Markdown and LaTeX).
"""

from __future__ import annotations

import csv
import io
from typing import Any

from vitexp.ledger import marks
from vitexp.report import aggregate
from vitexp.report.provenance import DERIVED_MARK

NOT_RUN = "not run"
NOT_RECORDED = "n/a"
CITED = "cited, not run"
NO_PAPER = "—"


def _fmt(value: Any, digits: int) -> str:
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    if isinstance(value, (list, tuple)):  # a per-layer metric
        return " / ".join(_fmt(v, digits) for v in value)
    return str(value)


def _same_as(row: dict[str, Any], col: dict[str, Any]) -> str | None:
    """A column's ``same_as`` text (``{key, when, text}``) where this row's cell only repeats column
    ``key``: every run behind the row has the config values of ``when`` (dotted keys: the runs'
    training makes the two equal, e.g. ``method.straight_through: true``) and the two cells hold the
    same value in every seed, to the digits shown. Elsewhere ``None``: the cell shows its number."""
    same = col.get("same_as")
    runs = row.get("runs") or []
    if not same or not runs:
        return None
    from vitexp.ledger.fingerprint import leaves

    if not all(
        leaves(r.get("config") or {}).get(k, object()) == v for r in runs for k, v in same["when"].items()
    ):
        return None
    digits = int(col.get("digits", 2))
    mine, theirs = row["cells"][col["key"]], row["cells"][same["key"]]
    if "n" in mine:
        a, b = mine.get("seeds") or {}, theirs.get("seeds") or {}
    else:
        a, b = {None: mine["value"]}, {None: theirs["value"]}
    if not a or a.keys() != b.keys() or any(v is None for v in [*a.values(), *b.values()]):
        return None
    return same["text"] if all(round(a[s], digits) == round(b[s], digits) for s in a) else None


def _cell_texts(row: dict[str, Any], col: dict[str, Any]) -> tuple[str, str]:
    cell = row["cells"][col["key"]]
    digits = int(col.get("digits", 2))
    same = _same_as(row, col)
    if same is not None:
        ours = same + _marks(cell)
    elif "n" in cell:  # a seeded row: mean ± std (n); a cost equal in every seed (GMACs) without "± 0"
        same = marks.cost_metric(col["key"]) and cell["std"] == 0 and cell["n"] > 1
        stat = aggregate.format_stat(
            cell["value"], None if same else cell["std"], cell["n"], digits, cell["expected"]
        )
        ours = stat + _marks(cell) if stat else _missing(row, col)
    elif cell["value"] is not None:
        ours = _fmt(cell["value"], digits) + _marks(cell)
    else:
        ours = _missing(row, col)
    return ours, _paper_text(cell)


def _marks(cell: dict[str, Any]) -> str:
    return f" {cell['marks']}" if cell.get("marks") else ""


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
    notes = [
        f"{DERIVED_MARK} {row['label']}, {col['label']}: {_paper_text(c)[:-1]} = {c['formula']}, obtained by "
        f"arithmetic from {c['source']}."
        for row in rows
        for col in spec["columns"]
        for c in [row["cells"][col["key"]]]
        if c.get("formula")
    ]
    notes += [str(n) for n in spec.get("notes") or []]
    name = spec.get("name", "TABLE")
    overlapping = {i for r in rows for i in r.get("overlapping") or ()}
    if overlapping:
        notes.append(
            f"{len(overlapping)} of the seeded runs (seeds 1 and up, no data_order in their protocol) drew "
            "epoch e's order from seed + e, so each repeated an epoch of the next seed: their seeds are not "
            f"independent and a std may be too small; vitexp-sweep {name} trains them again."
        )
    other = {i for r in rows for i in r.get("other_start") or ()}
    if other:
        notes.append(
            f"{len(other)} of the seeded runs fine-tuned another run of their shared start than the one "
            f"this table shows, so they measure other weights; vitexp-sweep {name} trains them again."
        )
    return (
        notes
        + mark_notes(rows)
        + [f"Left out by --skip-broken: {b}." for b in spec.get("skipped_broken") or []]
    )


#: What each cell mark says (:mod:`vitexp.ledger.marks`).
MARK_NOTES = {
    marks.STALE: (
        "trained under a protocol today's code no longer reproduces (no data_order: the sampler before "
        "seed * 1000003 + epoch); vitexp-train of today gives another number"
    ),
    marks.NO_DIFF: (
        "trained from a dirty tree whose diff was not kept, and not rebuilt by a rerun at its recorded "
        "commit: the code behind it cannot be rebuilt from the repository"
    ),
    marks.BUSY: (
        "timed while the machine had more runnable threads than cores: the throughput shared its cores"
    ),
}


#: Why a cell trained from a dirty tree without its diff carries no ‡ (:func:`vitexp.report.tables._mark`).
REBUILT_NOTE = (
    "recorded as trained from a dirty tree without its diff, carry no {mark}: every such run behind them "
    "was rerun at its recorded commit and gave every recorded metric again (vitexp-rebuild; "
    "its rebuild entries in the ledger), so the repository at that commit rebuilds them (the dirty flag "
    "of commits before 6014b6c counted every tracked file, tables and specs included)"
)


def mark_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One footnote per cell mark the table uses, with how many of its runs carry it; and how many
    cells lost their ‡ to a rebuild."""
    notes = []
    for mark, text in MARK_NOTES.items():
        cells = [c for r in rows for c in r["cells"].values() if mark in (c.get("marks") or "")]
        if cells:
            notes.append(f"{mark} {text} ({len(cells)} cell{'s' if len(cells) > 1 else ''}).")
    rebuilt = sum(bool(c.get("rebuilt")) for r in rows for c in r["cells"].values())
    if rebuilt:
        notes.append(
            f"{rebuilt} cell{'s' if rebuilt > 1 else ''}, " + REBUILT_NOTE.format(mark=marks.NO_DIFF) + "."
        )
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
    return [
        [
            row["label"],
            *(t for col in spec["columns"] for t in _cell_texts(row, col)),
            *(aggregate.paired_text(row, col) for col in paired),
        ]
        for row in rows
    ]


def render_markdown(spec: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The table by ``tabulate`` (GitHub Markdown), then units, the paper values' sources, footnotes and the
    runs."""
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
        lines += [
            "",
            (
                "Seeded rows: mean ± sample std (n seeds) over the seeds of the method's fine-tuning (a cost"
                " the same in every seed, such as a GMACs count, without ±); Δ: the paired difference to the"
                " row's baseline over the seeds both completed, mean ± std (n pairs)."
            ),
        ]
    again = sorted({i for r in rows for key in ("overlapping", "other_start") for i in r.get(key) or ()})
    if again:
        lines += ["", "Runs to train again (see the notes): " + ", ".join(f"`{i}`" for i in again) + "."]
    run_ids = sorted(
        {i for r in rows for c in r["cells"].values() for i in c.get("run_ids") or [c["run_id"]] if i}
    )
    if run_ids:
        lines += [
            "",
            "vitexp runs (the ledger: results/runs/ and its packs results/ledger/): "
            + ", ".join(f"`{i}`" for i in run_ids)
            + ".",
        ]
    return "\n".join(lines) + "\n"


#: Symbols the tables print, as LaTeX (after tabulate's own escaping).
UNICODE_TEX = (
    ("—", "---"),
    ("×", r"$\times$"),
    ("±", r"$\pm$"),
    ("Δ", r"$\Delta$"),
    ("†", r"\textsuperscript{\dag}"),
    ("§", r"\S{}"),
    ("‡", r"\textsuperscript{\ddag}"),
    ("≈", r"$\approx$"),
)


def _tex_escape(text: str) -> str:
    for a, b in (
        ("\\", r"\textbackslash{}"),
        ("&", r"\&"),
        ("%", r"\%"),
        ("_", r"\_"),
        ("#", r"\#"),
        *UNICODE_TEX[:4],
        (DERIVED_MARK, r"\textsuperscript{\dag}"),
        *UNICODE_TEX[5:],
    ):
        text = text.replace(a, b)
    return text


def render_latex(spec: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A booktabs ``tabular`` by ``tabulate`` (which escapes the cells) in a captioned table, then
    footnotes."""
    from tabulate import tabulate

    head = _header(spec)
    tabular = tabulate(
        _body(spec, rows),
        headers=head,
        tablefmt="latex_booktabs",
        disable_numparse=True,
        colalign=("left",) + ("right",) * (len(head) - 1),
    )
    for a, b in UNICODE_TEX:  # tabulate escapes LaTeX's specials; these symbols it leaves as they are
        tabular = tabular.replace(a, b)
    units = "; ".join(f"{c['label']}: {c.get('unit', '')}" for c in spec["columns"])
    notes = [r"\par\footnotesize " + _tex_escape(n) for n in footnotes(spec, rows)]
    return (
        "\n".join(
            [
                r"\begin{table}[t]",
                r"\centering",
                rf"\caption{{{_tex_escape(spec['title'])}}}",
                tabular,
                *notes,
                f"% {len(head)} columns; units: {_tex_escape(units)}",
                r"\end{table}",
            ]
        )
        + "\n"
    )


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
            line += [
                ours,
                "" if c["paper"] is None else c["paper"],
                c["source"] or "",
                c.get("formula") or "",
                c["run_id"] or "",
            ]
        line += aggregate.csv_cells(spec, row)
        writer.writerow(line)
    return buf.getvalue()
