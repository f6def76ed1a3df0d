"""Table specs (``sweeps/<table>.yaml``) joined with the ledger -> Markdown, LaTeX, CSV and a cost-vs-
accuracy plot (:mod:`vitexp.report.plots`) in ``results/tables/``.

Its reasoning: docs/tables.md, "vitexp/report/tables.py".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from vitexp import SWEEPS_DIR
from vitexp.config import rows as vrows
from vitexp.config.rows import check_rows, composing, expand_rows, row_name, row_query
from vitexp.cost import CostContext, table_cost, write_cost, write_summary
from vitexp.errors import ConfigError, one_line
from vitexp.ledger import (
    BrokenEntry,
    Ledger,
    LedgerError,
    atomic_write,
    default_results_dir,
    effective_status,
    marks,
    portable_path,
)
from vitexp.ledger.sources import WandbError, write_snapshot
from vitexp.report import aggregate, protocol_prose, protocols, results_page
from vitexp.report.plots import render_plot, series_curves  # noqa: F401 (series_curves: the tables' API too)
from vitexp.report.provenance import provenance_errors
from vitexp.report.render import footnotes, render_csv, render_latex, render_markdown
from vitexp.runs.loggers import log_tables
from vitexp.runs.owner import ArgumentParser


def load_spec(table: str | Path) -> dict[str, Any]:
    """A table spec by name (``sweeps/<name>.yaml``) or path; a clear error lists valid names."""
    path = Path(table)
    if not path.suffix:
        path = SWEEPS_DIR / f"{table}.yaml"
    if not path.is_file():
        valid = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))
        raise FileNotFoundError(
            f"table spec {portable_path(path)} not found; valid tables: {valid}; "
            f"verdict tables (sweeps/verdicts/): {protocols.verdict_files()}"
        )
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
        vrows.row_seeds(spec, row)  # a malformed seeds list fails here
    problems = provenance_errors(spec)
    if problems:
        raise ValueError(f"{path}: paper values without provenance: " + "; ".join(problems))
    return spec


def all_specs() -> list[str]:
    return sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))


def row_by_name(name: str) -> dict[str, Any] | None:
    """The first table row (specs in name order, grids expanded) that runs an experiment and is
    recorded under ``name`` (:func:`vitexp.config.rows.row_name`); ``None`` when no spec has one."""
    for table in all_specs():
        for row in load_spec(table)["rows"]:
            if row.get("experiment") and row_name(row) == name:
                return row
    return None


def wandb_runs(path: str) -> list[dict[str, Any]]:
    """Runs of a W&B project (``ENTITY/PROJECT``) as ledger records (:meth:`vitexp.ledger.Ledger.wandb`)."""
    return Ledger.wandb(path).records


def _cells(
    spec: dict[str, Any], row: dict[str, Any], by_seed: dict[int | None, list[dict[str, Any]]], seeded: bool
) -> dict[str, dict[str, Any]]:
    """Each column's cell: vitexp's value (per seed, for a seeded row) and the paper's."""
    cells = {}
    for col in spec["columns"]:
        key = col["key"]
        paper = (row.get("paper") or {}).get(key) or {}
        cell = {
            "paper": paper.get("value"),
            "source": paper.get("source"),
            "formula": paper.get("formula") if paper.get("derived") else None,
        }
        if seeded:
            cells[key] = {**aggregate.seeded_cell(by_seed, key), **cell}
            continue
        value, run_id = None, None
        for r in by_seed.get(None, []):  # oldest first: the newest run wins
            v = (r.get("metrics") or {}).get(key)
            if v is not None:
                value, run_id = v, r["run_id"]
        cells[key] = {"value": value, "run_id": run_id, **cell}
    return cells


def _mark(
    cells: dict[str, dict[str, Any]], runs: dict[str, dict[str, Any]], rebuilt: set[str] = frozenset()
) -> None:
    """Each cell's ``marks`` (:mod:`vitexp.ledger.marks`) from the runs behind it: a stale protocol
    (not on a cost metric, which the data order does not change), a dirty tree without its diff that
    no rerun at its commit rebuilt (``rebuilt``: such a cell is flagged ``rebuilt`` for the notes),
    and, in a throughput column, a busy machine."""

    def no_diff(r):
        return marks.diff_missing(r) and r["run_id"] not in rebuilt

    for key, cell in cells.items():
        behind = [runs[i] for i in cell.get("run_ids") or [cell.get("run_id")] if i in runs]
        stale = None if marks.cost_metric(key) else marks.stale
        cell["marks"] = "".join(
            mark
            for mark, hit in (
                (marks.STALE, stale),
                (marks.NO_DIFF, no_diff),
                (marks.BUSY, marks.busy if "throughput" in key else None),
            )
            if hit and any(hit(r) for r in behind)
        )
        cell["rebuilt"] = marks.NO_DIFF not in cell["marks"] and any(marks.diff_missing(r) for r in behind)


def fill(
    spec: dict[str, Any], runs: "Ledger | Iterable[dict[str, Any]]", overrides: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """For every row and column: vitexp's value (the newest completed run of the row's configuration
    with that metric, :meth:`vitexp.ledger.Ledger.row_runs`; of each kind one run,
    :func:`vitexp.report.aggregate.chosen`),
    its run id, the paper's value and source. ``overrides``: those the rows were swept with. A broken
    entry the table could depend on raises :class:`vitexp.ledger.LedgerError` unless the spec lists it
    under ``skipped_broken`` (``vitexp-tables --skip-broken``)."""
    ledger = Ledger.of(runs)
    skipped = set(spec.get("skipped_broken") or ())
    unexpected = [b for b in broken_for(spec, ledger, overrides) if str(b) not in skipped]
    if unexpected:
        raise LedgerError(unexpected, ledger.source)
    keys = [c["key"] for c in spec["columns"]]
    rows = expand_rows(spec["rows"])
    # an eval entry re-tests a training run's weights under its name (vitexp-eval): it checks a cell, never
    # fills one
    starts = {
        row_name(r): (ledger.newest(row_name(r), "train") or {}).get("run_id")
        for r in rows
        if r.get("experiment") and vrows.shared_start(spec, r)
    }
    with composing():
        filled = [_fill_row(spec, row, ledger, keys, starts, overrides) for row in rows]
    aggregate.paired_cells(spec, filled)
    for row in filled:  # a label may name a measured ratio (results_page: {ratio:A:B:COL})
        row["label"] = results_page.fill_text(spec, filled, row["label"])
    return filled


def _fill_row(
    spec: dict[str, Any],
    row: dict[str, Any],
    ledger: Ledger,
    keys: list[str],
    starts: dict[str, str | None],
    overrides: Sequence[str],
) -> dict[str, Any]:
    """One row of :func:`fill`."""
    name, query = row_name(row), row_query(spec, row, overrides)
    wanted = row.get("protocol") or spec.get("protocol") or {}  # e.g. {mode: compare}: only such runs
    found = ledger.row_runs(query) if query else {None: []}
    done = {
        seed: [
            r
            for r in rs
            if r["status"] == "completed"
            and r["kind"] not in ("eval", "rehearsal")
            and all((r.get("protocol") or {}).get(k) == v for k, v in wanted.items())
            # a compiled run measures the compiled model's speed: only a row that asks for it takes it
            and ("compile" in wanted or not (r.get("protocol") or {}).get("compile"))
        ]
        for seed, rs in found.items()
    }
    by_seed = {seed: aggregate.chosen(rs, keys) for seed, rs in done.items()}
    seeds = query.seeds if query else None
    cells = _cells(spec, row, by_seed, seeds is not None)
    _mark(cells, {r["run_id"]: r for rs in by_seed.values() for r in rs}, ledger.rebuilt)
    cited_ids = {i for c in cells.values() for i in c.get("run_ids") or [c.get("run_id")] if i}
    cited = [r for rs in by_seed.values() for r in rs if r["run_id"] in cited_ids]
    pending = [effective_status(r) for r in ledger.named(name) if r["status"] == "running"] if name else []
    return {
        "label": row["label"],
        "experiment": name,
        "cited": bool(row.get("cited")),
        "series": row.get("series"),
        "cells": cells,
        "seeds": seeds,
        "baseline": row.get("baseline"),
        "runs": cited,
        "overlapping": sorted(
            {r["run_id"] for r in cited if seeds is not None and aggregate.overlapping_order(r)}
        ),
        "other_start": sorted(
            {r["run_id"] for r in cited if seeds is not None and aggregate.other_start(r, starts, ledger)}
        ),
        "pending": pending[-1] if pending else None,
        "trained": any(r.get("kind") == "train" for rs in done.values() for r in rs),
    }


def write_table(
    spec: dict[str, Any],
    runs: "Ledger | Iterable[dict[str, Any]]",
    out_dir: Path,
    overrides: Sequence[str] = (),
) -> dict[str, str]:
    """Write <name>.md/.tex/.csv/.png (each through :func:`vitexp.ledger.atomic_write`)."""
    return _write(spec, fill(spec, runs, overrides), out_dir)


def _write(spec: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path) -> dict[str, str]:
    written = {}
    for ext, text in (
        ("md", render_markdown(spec, rows)),
        ("tex", render_latex(spec, rows)),
        ("csv", render_csv(spec, rows)),
    ):
        written[ext] = str(atomic_write(out_dir / f"{spec['name']}.{ext}", text))
    if spec.get("plot"):
        written["png"] = str(
            atomic_write(
                out_dir / f"{spec['name']}.png",
                lambda tmp: render_plot(spec, rows, Path(tmp), footnotes(spec, rows)),
            )
        )
    return written


def broken_for(spec: dict[str, Any], ledger: Ledger, overrides: Sequence[str] = ()) -> list[BrokenEntry]:
    """The broken entries that could change a cell of ``spec``: named like one of its rows, or
    holding a config that could be one of its rows' (:meth:`vitexp.ledger.Ledger.broken_for`)."""
    if not ledger.broken:
        return []
    with composing():
        queries = [
            row_query(spec, row, overrides)
            for row in expand_rows(spec["rows"])
            if row.get("experiment") and not row.get("cited")
        ]
        return ledger.broken_for(table_names(spec), [q for q in queries if q is not None])


def table_names(spec: dict[str, Any]) -> list[str]:
    """The ledger names a table's cells can come from (its rows' names and seeded names)."""
    names = []
    for row in expand_rows(spec["rows"]):
        name = row_name(row)
        if name:
            names += [name, *(aggregate.seeded_name(name, s) for s in vrows.row_seeds(spec, row) or ())]
    return names


def _closing(status: str, error: str, code: int) -> int:
    print(f"vitexp-tables: {status}: {error}", file=sys.stderr)
    print(json.dumps({"status": status, "error": error, "ledger": None}))
    return code


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="vitexp-tables",
        description=(
            "Join the ledger with the table specs in sweeps/ and write"
            " results/tables/<table>.{md,tex,csv,png}."
        ),
    )
    parser.add_argument(
        "tables",
        nargs="*",
        help=(
            f"table names (default: all of {all_specs()}), then any Hydra "
            "overrides the rows were swept with (trainer=ddp): a row's runs are those of its composed config"
        ),
    )
    parser.add_argument(
        "--wandb",
        metavar="ENTITY/PROJECT",
        help="read runs through wandb.Api() instead of the ledger (and log the tables there)",
    )
    parser.add_argument(
        "--log-wandb",
        metavar="[ENTITY/]PROJECT",
        nargs="?",
        const="",
        help=(
            "log each table (wandb.Table) and its plot to W&B: to PROJECT, else --wandb's, else the "
            "project runs log to (conf/logger/wandb.yaml); offline unless logged in (wandb sync uploads it)"
        ),
    )
    parser.add_argument(
        "--results-dir", type=Path, default=None, help="results root (default: $VITEXP_RESULTS or results/)"
    )
    parser.add_argument(
        "--ledger",
        type=Path,
        default=None,
        help="read the runs from this results root, runs folder or snapshot (.jsonl[.gz]) instead",
    )
    parser.add_argument(
        "--snapshot",
        type=Path,
        default=None,
        metavar="FILE.jsonl.gz",
        help="also write the ledger read as one compact snapshot file (a release's results)",
    )
    parser.add_argument(
        "--pack",
        action="store_true",
        help=(
            "first fold the completed entries of <results-dir>/runs/ into one compressed file "
            "<results-dir>/ledger/<time>.jsonl.gz and remove their files (vitexp.ledger.packs)"
        ),
    )
    parser.add_argument(
        "--skip-broken",
        action="store_true",
        help=(
            "write tables even where a broken ledger entry could change a cell (each skipped file is "
            "listed in the table's notes and the closing line)"
        ),
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default: <results-dir>/tables)"
    )
    parser.add_argument(
        "--results-page",
        type=Path,
        default=None,
        metavar="PATH",
        help=(
            "also write the results page there (vitexp.report.results_page; default: docs/results.md when "
            "the project's own ledger is written into results/tables)"
        ),
    )
    args = parser.parse_intermixed_args(argv)
    results_dir = args.results_dir or default_results_dir()
    out_dir = args.out or results_dir / "tables"
    overrides = [t for t in args.tables if "=" in t]
    named = [t for t in args.tables if "=" not in t]
    verdicts = [t for t in named if t in protocols.verdict_files()] if named else protocols.verdict_files()
    try:
        specs = [load_spec(t) for t in ([t for t in named if t not in verdicts] if named else all_specs())]
        for verdict in verdicts:  # checked before anything is written
            protocols.load(verdict)
    except (FileNotFoundError, ValueError) as err:
        return _closing("invalid", one_line(err), 2)
    from vitexp.runs.lock import RunFolderLock

    created = not out_dir.exists()
    try:  # one writer per output folder: a second is refused, naming the first
        lock = RunFolderLock(out_dir, TABLES_LOCK, TABLES_REFUSAL).acquire()
    except ConfigError as err:
        return _closing("failed", one_line(err), 1)
    try:
        return _tables(args, specs, verdicts, overrides, results_dir, out_dir)
    finally:
        lock.release()
        if created and [p.name for p in out_dir.iterdir()] == [TABLES_LOCK]:  # nothing written: as it was
            lock.path.unlink(missing_ok=True)
            out_dir.rmdir()


#: The lock of a ``--out`` folder (:class:`vitexp.runs.lock.RunFolderLock`: ``flock``, naming its owner).
TABLES_LOCK = ".tables.lock"
TABLES_REFUSAL = (
    "{folder} is being written by vitexp-tables, process {pid} on {host} (since {since}); one writer per"
    " output folder: wait for it to end, or write to another --out"
)


def _tables(args, specs, verdicts, overrides, results_dir: Path, out_dir: Path) -> int:
    """The body of :func:`main` under the output folder's lock."""
    if args.pack:
        from vitexp.ledger.packs import pack

        try:
            packed = pack(results_dir)
        except (ValueError, FileExistsError, RuntimeError) as err:
            return _closing("failed", f"--pack: {one_line(err)}", 1)
        print(
            f"vitexp-tables: packed {packed['packed']} completed entries into "
            f"{portable_path(Path(packed['pack']).resolve(), results_dir) if packed['pack'] else 'nothing'}; "
            f"{packed['left']} left in runs/",
            file=sys.stderr,
        )
    try:
        ledger = Ledger.wandb(args.wandb) if args.wandb else Ledger.load(args.ledger or results_dir)
    except WandbError as err:  # no W&B login, no network, no such project
        return _closing("failed", one_line(err), 1)
    except FileNotFoundError as err:  # --ledger names no file
        return _closing("invalid", f"--ledger: {one_line(err)}", 2)
    skipped = {spec["name"]: broken_for(spec, ledger, overrides) for spec in specs}
    if not args.skip_broken and any(skipped.values()):
        refused = sorted({str(b) for bs in skipped.values() for b in bs})
        return _closing(
            "failed",
            f"{LedgerError([b for bs in skipped.values() for b in bs], ledger.source)}; "
            f"tables not written: {sorted(n for n, bs in skipped.items() if bs)} (fix or remove the "
            f"file{'s' if len(refused) > 1 else ''}, or pass --skip-broken to leave them out)",
            1,
        )
    cache: dict[str, list[dict]] = {}

    def filled_spec(
        spec: dict[str, Any],
    ) -> list[dict]:  # each table filled once: its files, verdicts, the page
        if spec["name"] not in cache:
            skip = [str(b) for b in broken_for(spec, ledger, overrides)] if args.skip_broken else []
            cache[spec["name"]] = fill({**spec, "skipped_broken": skip}, ledger, overrides)
        return cache[spec["name"]]

    written, costs, cost_context = {}, {}, CostContext.of(ledger)
    for spec in specs:
        spec = {**spec, "skipped_broken": [str(b) for b in skipped[spec["name"]]]}
        written[spec["name"]] = _write(spec, filled_spec(spec), out_dir)
        print(Path(written[spec["name"]]["md"]).read_text())
        costs[spec["name"]] = table_cost(spec, ledger, cost_context)  # GPU-hours of the rows (vitexp.cost)
        cost = write_cost(costs[spec["name"]], out_dir)
        if cost is not None:
            written[spec["name"]]["cost"] = str(cost)
            print(cost.read_text())
    # a verdict's table: its spec read and its rows filled once, shared with the tables written above
    fill_table = lambda table: cache.get(table) or filled_spec(load_spec(table))  # noqa: E731
    claim_texts: dict[str, str] = {}  # each verdict file evaluated once: its table and the results page

    def claim_text(name: str) -> str:
        if name not in claim_texts:
            claim_texts[name] = protocols.text(name, fill_table, ledger, load_spec)
        return claim_texts[name]

    written.update(protocols.write(verdicts, claim_text, out_dir, atomic_write))
    for name, runs in sorted(ledger.unmatched.items()):  # named like a row, of another configuration
        shown_runs = "; ".join(
            f"{run_id} ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''})"
            for run_id, keys in sorted(runs.items())
        )
        print(
            f"vitexp-tables: {len(runs)} run(s) named {name} left out, their config differs from the row's"
            f" in: {shown_runs}",
            file=sys.stderr,
        )
    page = args.results_page or results_page.default_page(
        results_dir, out_dir, bool(args.ledger or args.wandb or overrides)
    )
    if page:  # every spec's verdict, filled from the same ledger (vitexp.report.results_page)
        claims = [(name, claim_text(name)) for name in protocols.verdict_files()]
        results_page.write(
            [load_spec(n) for n in all_specs()], filled_spec, page, atomic_write, out_dir, claims
        )
        if (
            Path(page).resolve() == results_page.DEFAULT_PAGE.resolve()
        ):  # the project's own: its README and docs too
            for name, text in claims:  # their generated verdicts (vitexp.report.protocol_prose)
                protocol_prose.write_pages(protocols.load(name), protocols.prose(text), atomic_write)
        every_cost = [costs.get(n) or table_cost(load_spec(n), ledger, cost_context) for n in all_specs()]
        if page == results_page.DEFAULT_PAGE:  # the project's own ledger: docs/cluster.md's generated section
            write_summary(
                every_cost, ledger=ledger
            )  # "What each table costs" (another ledger's page has none)
    if args.snapshot:
        write_snapshot(ledger.records, args.snapshot)
    logs = args.log_wandb is not None or bool(args.wandb)
    url = log_tables(written, args.log_wandb or args.wandb, results_dir) if logs else None
    shown = {
        name: {k: portable_path(Path(v).resolve(), results_dir) for k, v in files.items()}
        for name, files in written.items()
    }
    print(
        json.dumps(
            {
                "status": "completed",
                "tables": shown,
                "runs_read": len(ledger),
                "skipped_broken": sorted({str(b) for bs in skipped.values() for b in bs}),
                "source": args.wandb or portable_path(Path(ledger.source).resolve(), results_dir),
                "wandb": portable_path(url, results_dir),
            }
        )
    )  # an offline run's folder, relative
    return 0
