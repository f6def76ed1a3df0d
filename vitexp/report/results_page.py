"""The results page (``docs/results.md``), written by ``vitexp-tables`` from the tables and each spec's
``verdict:``, so that no number in its prose is typed by hand.

Its reasoning: docs/tables.md, "vitexp/report/results_page.py".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from vitexp.ledger import marks
from vitexp.report import aggregate

#: Where ``vitexp-tables`` writes the page when it reads the project's own ledger into results/tables.
DEFAULT_PAGE = Path(__file__).resolve().parents[2] / "docs" / "results.md"
#: The generated tables the page links (``../results/tables/`` from ``docs/``).
TABLES_DIR = DEFAULT_PAGE.parent.parent / "results" / "tables"
#: The order of the page's sections: the seeded Fashion-MNIST tier first, then the rest by name.
ORDER = (
    "fmnist_bspf_table1",
    "fmnist_bspf_table2",
    "fmnist_bspf_table6",
    "fmnist_bspf_table7",
    "fmnist_bspf_table8",
    "fmnist_bspf_protocols",
    "fmnist_bspf_ft2",
    "fmnist_bspf_scratch",
    "fmnist_bspf_long",
    "fmnist_bspf_grid14",
    "fmnist_bspf_grid14_split1",
    "fmnist_saper_table1",
    "fmnist_saper_rules",
    "fmnist_saper_rules_selected",
    "fmnist_raptor",
)
#: How a verdict marks a number that no table cell holds.
HAND_MARKS = ("(paper: ",)
PLACEHOLDER = re.compile(r"\{(cell|delta|diff|saved|ratio|paper):([^{}]+)\}")
#: The placeholders that name two rows.
TWO_ROWS = ("diff", "saved", "ratio")
NOT_RUN = "not run"


def _signed(text: str) -> str:
    return "−" + text[1:] if text.startswith("-") else text


def _stat(mean: float | None, std: float | None, digits: int, signed: bool = False) -> str:
    if mean is None:
        return NOT_RUN
    text = f"{mean:{'+' if signed else ''}.{digits}f}"
    if std is not None:
        text += f" ± {std:.{digits}f}"
    return _signed(text)


def _partial(n: int | None, expected: int | None, value: float | None) -> str:
    """`` (n of N seeds)`` after a seeded value from fewer seeds than its row asks for, as the table's cell
    says."""
    return f" ({n} of {expected} seeds)" if value is not None and n and expected and n < expected else ""


def _lookup(
    spec: dict[str, Any], rows: list[dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    by_name = {r["experiment"]: r for r in rows if r.get("experiment")}
    by_name.update({r["label"]: r for r in rows if not r.get("experiment")})  # cited rows: by label
    digits = {c["key"]: int(c.get("digits", 2)) for c in spec["columns"]}
    return by_name, digits


def _render(kind: str, args: list[str], by_name: dict[str, dict[str, Any]], digits: dict[str, int]) -> str:
    """One placeholder's text; KeyError names what the table does not have."""
    *names, key = args
    if key not in digits:
        raise KeyError(f"column {key!r}")
    for name in names:
        if name not in by_name:
            raise KeyError(f"row {name!r}")
    d = digits[key]
    if kind == "paper":
        value = by_name[names[0]]["cells"][key]["paper"]
        return NOT_RUN if value is None else str(value)  # as published: no digits the paper did not give
    if kind == "cell":  # a cost is deterministic: its std over seeds is not shown
        cell = by_name[names[0]]["cells"][key]
        text = _stat(cell["value"], None if marks.cost_metric(key) else cell.get("std"), d)
        return text + _partial(cell.get("n"), cell.get("expected"), cell["value"])
    if kind == "delta":
        diff = (by_name[names[0]].get("paired") or {}).get(key)
        if diff is None:
            raise KeyError(
                f"paired column {key!r} of row {names[0]!r} (no baseline, or the column is not paired)"
            )
        expected = by_name[names[0]]["cells"][key].get("expected")
        return _stat(diff["mean"], diff["std"], d, signed=True) + _partial(
            diff.get("n"), expected, diff["mean"]
        )
    a, b = (by_name[n]["cells"][key] for n in names)
    if kind in ("saved", "ratio"):
        if a["value"] is None or b["value"] is None:
            return NOT_RUN
        if kind == "ratio":
            return _signed(f"{100 * (a['value'] / b['value'] - 1):+.2f} %")
        return f"{100 * (1 - a['value'] / b['value']):.0f}"
    if a.get("seeds") is not None and b.get("seeds") is not None:
        diff = aggregate.paired_difference(a["seeds"], b["seeds"])
        expected = min(a.get("expected") or 0, b.get("expected") or 0) or None
        return _stat(diff["mean"], diff["std"], d, signed=True) + _partial(diff["n"], expected, diff["mean"])
    if a["value"] is None or b["value"] is None:
        return NOT_RUN
    return _stat(a["value"] - b["value"], None, d, signed=True)


def fill_verdict(spec: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The spec's verdict with every placeholder replaced by the cell it names."""
    return fill_text(spec, rows, str(spec.get("verdict") or "").strip())


def fill_text(spec: dict[str, Any], rows: list[dict[str, Any]], text: str) -> str:
    """``text`` (a verdict, a row label) with every placeholder replaced by the cell it names."""
    if "{" not in text:
        return text
    by_name, digits = _lookup(spec, rows)

    def one(match: re.Match) -> str:
        kind, args = match.group(1), match.group(2).split(":")
        if len(args) != (3 if kind in TWO_ROWS else 2):
            raise ValueError(
                f"{spec['name']}: verdict placeholder {match.group(0)} takes "
                f"{'ROW_A:ROW_B:COL' if kind in TWO_ROWS else 'ROW:COL'}"
            )
        try:
            return _render(kind, args, by_name, digits)
        except KeyError as err:
            raise ValueError(
                f"{spec['name']}: verdict placeholder {match.group(0)}: the table has no {err.args[0]}; "
                f"rows: {sorted(by_name)}"
            ) from None

    return PLACEHOLDER.sub(one, text)


def verdict_errors(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a spec's verdict (empty: nothing): an unknown row, column or form."""
    try:
        fill_verdict(spec, rows)
    except ValueError as err:
        return [str(err)]
    return []


def section(spec: dict[str, Any], rows: list[dict[str, Any]], tables_dir: Path = TABLES_DIR) -> str:
    """One table's section: its title, the verdict, links to the table and its plot (where
    ``tables_dir`` holds them: a table no one has written yet says so)."""
    name = spec["name"]
    written = (Path(tables_dir) / f"{name}.md").is_file()
    link = (
        f"[table](../results/tables/{name}.md)"
        if written
        else "no table written yet (`vitexp-tables " + name + "`)"
    )
    lines = [f"## {spec['title']}", "", f"`sweeps/{name}.yaml` → {link}", ""]
    verdict = fill_verdict(spec, rows)
    lines += [verdict if verdict else "No verdict written in the spec yet (`verdict:`).", ""]
    if spec.get("plot") and (Path(tables_dir) / f"{name}.png").is_file():
        lines += [f"![{spec['title']}](../results/tables/{name}.png)", ""]
    return "\n".join(lines)


def claims_section(name: str, markdown: str) -> str:
    """A claim-by-claim table (:func:`vitexp.report.protocols.text`) as a section: its title one level down,
    the file it is written to, then the table and its notes."""
    title, _, body = markdown.partition("\n")
    return "\n".join(
        [
            f"#{title}",
            "",
            f"`sweeps/verdicts/{name}.yaml` → [table](../results/tables/{name}.md)",
            body.rstrip(),
            "",
        ]
    )


def page(sections: list[tuple[str, str]]) -> str:
    """The whole page from (spec name, section) pairs."""
    rank = {n: i for i, n in enumerate(ORDER)}
    body = [s for _, s in sorted(sections, key=lambda p: (rank.get(p[0], len(rank)), p[0]))]
    head = [
        (
            "<!-- Generated by vitexp-tables from results/tables and each spec's "
            "`verdict:`; do not edit: edit the spec and run vitexp-tables. -->"
        ),
        "",
        "# Results",
        "",
        (
            "*This page is generated by `vitexp-tables` from the ledger and the specs in `sweeps/`: every"
            " number in a verdict is a table cell, filled in when the page is written; the tables themselves"
            " are in `results/tables/`. Numbers that no cell holds say where they come from.*"
        ),
        "",
        (
            "A seeded cell is the mean ± sample std over its seeds (the Fashion-MNIST tier: fine-tuning seeds"
            " 0, 1, 2 from the shared pretrained baseline); Δ is the paired difference to the table's"
            " baseline row over the same seeds, and a difference between two method rows is paired over the"
            " seeds both have. Every cited seed run that trained drew independent epoch orders ([the"
            ' tier](fashion-mnist.md), "Independent seeds"); the earlier, overlapping runs stay in the ledger'
            " and are listed under their table."
        ),
        "",
    ]
    return "\n".join(head + body).rstrip() + "\n"


def default_page(results_dir: Path, out_dir: Path, other_source: bool) -> Path | None:
    """:data:`DEFAULT_PAGE` when ``vitexp-tables`` writes the project's own tables from its own
    ledger (``results/`` into ``results/tables/``, nothing read from elsewhere); else None: a page
    of another ledger is written only where ``--results-page`` says."""
    root = DEFAULT_PAGE.parent.parent / "results"
    own = (
        Path(results_dir).resolve() == root.resolve()
        and Path(out_dir).resolve() == (root / "tables").resolve()
    )
    return DEFAULT_PAGE if own and not other_source else None


def write(
    specs: list[dict[str, Any]],
    fill: Callable[[dict[str, Any]], list[dict[str, Any]]],
    path: Path,
    write_text: Callable[[Path, str], Any],
    tables_dir: Path = TABLES_DIR,
    claims: list[tuple[str, str]] = (),
) -> Path:
    """Write the page for ``specs`` (every spec in sweeps/), each filled by ``fill``, and the
    claim-by-claim tables ``claims`` ((name, markdown): :func:`claims_section`)."""
    sections = [(spec["name"], section(spec, fill(spec), tables_dir)) for spec in specs]
    sections += [(name, claims_section(name, text)) for name, text in claims]
    write_text(path, page(sections))
    return path
