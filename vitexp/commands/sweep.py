"""``vitexp-sweep TABLE``: launch every row of a table spec as one Hydra multirun.

Its reasoning: docs/commands.md, "vitexp/commands/sweep.py".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from vitexp import CONF_DIR
from vitexp.commands import recheck
from vitexp.config.rows import (
    composing,
    expand_rows,
    job_arguments,
    row_name,
    row_query,
    row_seeds,
    row_weights,
    shared_start,
)
from vitexp.cost import rehearsal
from vitexp.errors import one_line
from vitexp.ledger import (
    RUN_WEIGHTS_PREFIX,
    KeptWeightsError,
    Ledger,
    LedgerError,
    default_results_dir,
    effective_status,
    keep,
    portable_text,
    weights_run,
)
from vitexp.ledger.fingerprint import WEIGHTLESS_KINDS
from vitexp.report.aggregate import other_start, overlapping_order, seeded_name
from vitexp.report.tables import all_specs, broken_for, load_spec
from vitexp.runs.owner import ArgumentParser

APPS = {"train": "vitexp-train", "flops": "vitexp-flops", "bench": "vitexp-bench"}


def _script(app: str) -> str:
    """The console script beside this interpreter (the same environment), else on PATH."""
    local = Path(sys.executable).parent / app
    if local.exists():
        return str(local)
    found = shutil.which(app)
    if not found:
        raise FileNotFoundError(f"{app} not found beside {sys.executable} or on PATH: pip install -e .")
    return found


def plan(
    spec: dict, kind: str | None, force: bool, results_dir: Path, overrides: Sequence[str] = ()
) -> dict[str, dict]:
    """{kind: {"launch": [names], "skip": [names], "seeds": {row name: [seeds to launch]},
    "seeded": [names of seeded jobs], "jobs": {row name: [Hydra arguments]}, "loads": {row name: the
    shared start its job loads, or ``None``}} for the spec's runnable rows; a name is the row's
    (:func:`vitexp.config.rows.row_name`), or ``<name>+seed=<s>`` for one seed of a seeded row. A row's runs
    are those of its configuration composed with ``overrides`` (:meth:`vitexp.ledger.Ledger.row_runs`);
    a broken entry that could be one of them stops the plan (:class:`vitexp.ledger.LedgerError`)."""
    out: dict[str, dict] = {}
    ledger = Ledger.load(results_dir)
    broken = broken_for(spec, ledger, overrides)  # by name, and by the config a broken entry holds
    if broken:
        raise LedgerError(broken, ledger.source)
    starts, absent = (
        _current_starts(spec, ledger, force, results_dir) if kind in (None, "train") else ({}, [])
    )
    with composing():
        for row in expand_rows(spec["rows"]):
            _plan_row(spec, row, kind, force, overrides, ledger, starts, out)
        train = out.get("train", {})
        needed = {
            train["loads"].get(name) for name in train.get("seeds", {})
        }  # the starts of rows with a seed to train
        for name in absent:
            if name in needed:  # a seed to train from it needs its weights: it trains again
                starts[name] = None
                print(
                    f"vitexp-sweep: {name} is the shared start other rows load (run:{name}), and its weights"
                    " are not on this machine: it runs again, and so do the seeded rows fine-tuned from it",
                    file=sys.stderr,
                )
            else:
                print(
                    f"vitexp-sweep: {name} is the shared start other rows load (run:{name}); its weights are"
                    " not on this machine, but no row that loads it has a seed to train: it is not trained"
                    " again",
                    file=sys.stderr,
                )
        if needed & set(absent):  # only the start and the runs fine-tuned from it change (other_start)
            out = {}
            for row in expand_rows(spec["rows"]):
                _plan_row(spec, row, kind, force, overrides, ledger, starts, out)
    return out


def _plan_row(
    spec: dict,
    row: dict,
    kind: str | None,
    force: bool,
    overrides: Sequence[str],
    ledger: Ledger,
    starts: dict[str, str | None],
    out: dict[str, dict],
) -> None:
    """One row's jobs into ``out`` (:func:`plan`)."""
    if row.get("cited") or not row.get("experiment"):
        return
    exp, name = row["experiment"], row_name(row)
    if not (CONF_DIR / "experiment" / f"{exp}.yaml").is_file():
        raise FileNotFoundError(f"row {row['label']!r}: no experiment config conf/experiment/{exp}.yaml")
    k = kind or row.get("run", "train")
    if k not in APPS:
        raise ValueError(f"row {row['label']!r}: run {k!r} is not one of {sorted(APPS)}")
    bucket = out.setdefault(k, {"launch": [], "skip": [], "seeds": {}, "seeded": [], "jobs": {}, "loads": {}})
    seeds = row_seeds(spec, row)
    bucket["jobs"][name] = job_arguments(row, seeded=seeds is not None, weights=k not in WEIGHTLESS_KINDS)
    query = row_query(spec, row, overrides)
    bucket["loads"][name] = _loads(row, query, seeds, starts, ledger) if k not in WEIGHTLESS_KINDS else None
    found = ledger.row_runs(query)
    active = {
        seed: [r for r in rs if r["kind"] == k and effective_status(r) in ("completed", "running")]
        for seed, rs in found.items()
    }
    if seeds is not None:
        for seed in seeds:
            # a completed training seed from the older sampler, or fine-tuned from another run of its start,
            # runs again
            current = [
                r
                for r in active[seed]
                if k != "train"
                or r["status"] != "completed"
                or not (overlapping_order(r) or other_start(r, starts, ledger))
            ]
            target = "skip" if current and not force else "launch"
            if seeded_name(name, seed) not in bucket[target]:
                bucket[target].append(seeded_name(name, seed))
                bucket["seeded"].append(seeded_name(name, seed))
                if target == "launch":
                    bucket["seeds"].setdefault(name, []).append(seed)
        return
    done = bool(active[None])
    if k == "train" and name in starts:
        done = starts[name] is not None or any(r["status"] == "running" for r in active[None])
    target = "skip" if done and not force else "launch"
    if name not in bucket[target]:
        bucket[target].append(name)


def _loads(
    row: dict, query, seeds: list[int] | None, starts: dict[str, str | None], ledger: Ledger
) -> str | None:
    """The shared start (a key of ``starts``) whose weights the row's job loads: its composed
    ``backbone.pretrained`` (the experiment file's, the row's ``weights``, the sweep's overrides) as
    ``run:<start>`` or ``run:<a run id of the start>``; ``None`` for any other weights or none."""
    config = query.composed(seeds[0] if seeds else None) if query is not None else None
    ref = (
        str(((config or {}).get("backbone") or {}).get("pretrained") or "")
        if config
        else (row_weights(row) or "")
    )
    if not ref.startswith(RUN_WEIGHTS_PREFIX):
        return None
    start = ledger.experiment_of(ref[len(RUN_WEIGHTS_PREFIX) :])
    return start if start in starts else None


def _shared_starts(spec: dict) -> list[dict]:
    """The table's trained shared-start rows (:func:`vitexp.config.rows.shared_start`)."""
    return [
        row
        for row in expand_rows(spec["rows"])
        if not row.get("cited") and row.get("experiment") and shared_start(spec, row)
    ]


def _current_starts(
    spec: dict, ledger: Ledger, force: bool, results_dir: Path
) -> tuple[dict[str, str | None], list[str]]:
    """({shared start's name: the run its seeded rows load, or ``None`` when it trains again (no
    completed run, ``--force``)}, [the starts whose newest completed run has no weights on this
    machine]). Such a start stays its newest run while no row that loads it has a seed to train (a
    complete table needs no start: a fresh clone of the ledger reruns nothing); where one has,
    :func:`plan` trains that start again, and every seeded run fine-tuned from an earlier run of it
    trains again too, so a row never mixes two starts; the other starts and their rows stay."""
    starts: dict[str, str | None] = {}
    absent: list[str] = []
    for row in _shared_starts(spec):
        name = row_name(row)
        starts[name] = None
        newest = None if force else ledger.newest(name, "train")
        if newest is None:
            continue
        try:
            starts[name] = weights_run(f"{RUN_WEIGHTS_PREFIX}{name}", results_dir, ledger)["run_id"]
        except KeptWeightsError as err:  # a copy that is not the start's: stop, never train it again unseen
            raise ValueError(f"the shared start {name}: {one_line(err)}") from None
        except FileNotFoundError:
            starts[name] = newest["run_id"]
            absent.append(name)
    return starts, absent


def keep_starts(spec: dict, results_dir: Path) -> dict[str, dict]:
    """Keep the weights of the newest completed run of each of the table's shared starts
    (:func:`vitexp.ledger.keep`): {start's name: what was kept, or ``{"error": ...}`` when its weights
    are not on this machine}. A start with no completed run is left out."""
    ledger, kept = Ledger.load(results_dir), {}
    for row in _shared_starts(spec):
        run = ledger.newest(row_name(row), "train")
        if run is None:
            continue
        try:
            kept[row_name(row)] = keep(run, results_dir)
        except OSError as err:  # not on this machine, changed after the run (KeptWeightsError), a full disk
            kept[row_name(row)] = {"run_id": run["run_id"], "error": portable_text(one_line(err))}
    return kept


def _report_kept(kept: dict[str, dict]) -> None:
    for name, k in kept.items():
        if "error" in k:
            print(f"vitexp-sweep: {name}: not kept: {k['error']}", file=sys.stderr)
        else:
            print(
                f"vitexp-sweep: {name}: weights of run {k['run_id']}"
                f" {'kept' if k['copied'] else 'already kept'} at {k['kept']} (sha256 {k['sha256'][:12]})",
                file=sys.stderr,
            )


def job_list(rows: dict) -> list[list[str]]:
    """The Hydra arguments of each job to launch for one kind's plan: the plain unseeded rows as
    one multirun, each other unseeded row, then each seeded row with its missing seeds."""
    unseeded = [n for n in rows["launch"] if n not in rows["seeded"]]
    plain = [n for n in unseeded if rows["jobs"][n] == [f"experiment={n}"]]
    jobs = [[f"experiment={','.join(plain)}"]] if plain else []
    jobs += [rows["jobs"][n] for n in unseeded if n not in plain]
    return jobs + [
        [*rows["jobs"][n], f"seed={','.join(map(str, seeds))}"] for n, seeds in rows["seeds"].items()
    ]


def _recheck(spec: dict, results_dir: Path, args) -> int:
    """``--kind eval``: vitexp-eval each cited run (:func:`vitexp.commands.recheck.recheck`), one line per
    run.
    vitexp-eval reads and writes the ledger in ``results_dir`` (``$VITEXP_RESULTS``); the other
    overrides (``data.root=...``) are its own."""
    if args.dry_run:
        todo = recheck.to_evaluate(spec, results_dir, args.force)
        for run_id in todo:
            print(
                f"vitexp-sweep: {_script('vitexp-eval')} {run_id} {' '.join(args.overrides)}", file=sys.stderr
            )
        print(
            json.dumps({"table": spec["name"], "kind": "eval", "status": "dry_run", "would_evaluate": todo})
        )
        return 0
    env = {**os.environ, "VITEXP_RESULTS": str(results_dir)}
    overrides = [ov for ov in args.overrides if not ov.startswith("results_dir=")]
    evaluated = []

    def evaluate(run_id: str) -> int:
        cmd = [_script("vitexp-eval"), run_id, *overrides]
        print("vitexp-sweep: " + " ".join(cmd), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        if done.returncode == 0:
            evaluated.append(run_id)
        else:  # its closing JSON line says why
            print(
                f"vitexp-sweep: vitexp-eval {run_id} failed: {(done.stdout or '').strip()[-500:]}",
                file=sys.stderr,
            )
        return done.returncode

    result = recheck.recheck(spec, results_dir, evaluate, force=args.force, tolerance=args.tolerance)
    for line in recheck.report_lines(result):
        print(f"vitexp-sweep: {line}", file=sys.stderr)
    ok = not (result["disagree"] or result["not_evaluated"] or result["not_checkable"])
    print(
        json.dumps(
            {
                "table": spec["name"],
                "kind": "eval",
                "status": "completed" if ok else "failed",
                "checked": len(result["runs"]),
                "evaluated": evaluated,
                "disagree": result["disagree"],
                "not_evaluated": result["not_evaluated"],
                "not_checkable": result["not_checkable"],
                "tolerance": result["tolerance"],
            }
        )
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="vitexp-sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("table", help=f"a table spec in sweeps/: {all_specs()}")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every job")
    parser.add_argument("--force", action="store_true", help="rerun rows that already have a completed run")
    parser.add_argument(
        "--kind",
        choices=sorted([*APPS, "eval"]),
        help=(
            "launch this app for every row instead of each row's own; eval: re-evaluate "
            "every completed training run the table cites and compare its top-1"
        ),
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=recheck.DEFAULT_TOLERANCE,
        help="--kind eval: the largest |re-evaluated - ledger| top-1 (points) that agrees",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run nothing: the closing line says dry_run and lists what would run (would_launch, commands)",
    )
    parser.add_argument(
        "--keep-starts",
        action="store_true",
        help=(
            "run nothing: keep the weights of the table's shared starts in <results>/weights/ "
            "(vitexp.ledger.kept), so their seeded rows can be trained elsewhere or later"
        ),
    )
    rehearsal.add_arguments(parser)
    args = parser.parse_intermixed_args(argv)
    try:
        spec = load_spec(args.table)
        results_dir = default_results_dir()
        for ov in args.overrides:
            if ov.startswith("results_dir="):
                results_dir = Path(ov.split("=", 1)[1])
        if args.kind == "eval":
            return _recheck(spec, results_dir, args)
        if args.keep_starts:
            kept = keep_starts(spec, results_dir)
            _report_kept(kept)
            failed = any("error" in k for k in kept.values())
            print(
                json.dumps(
                    {"table": spec["name"], "status": "failed" if failed else "completed", "kept": kept}
                )
            )
            return 1 if failed else 0
        if args.rehearse:  # vitexp.cost.rehearsal: every row at full size, a few steps on synthetic data
            summary = rehearsal.rehearse_table(
                spec,
                rehearsal.settings_from(args),
                results_dir,
                args.rehearse_dir,
                args.overrides,
                args.force,
                args.dry_run,
                args.rehearse_timeout,
                rehearsal.only_from(args),
                args.rehearse_budget_s,
            )
            print(json.dumps(summary))
            return 0 if summary["status"] in ("completed", "dry_run") else 1
        todo = plan(spec, args.kind, args.force, results_dir, args.overrides)
    except (FileNotFoundError, ValueError) as err:
        print(f"vitexp-sweep: invalid: {one_line(err)}", file=sys.stderr)
        print(json.dumps({"status": "invalid", "error": portable_text(one_line(err)), "ledger": None}))
        return 2
    launch, skipped, commands = {}, {}, []
    for kind, rows in todo.items():
        skipped[kind] = rows["skip"]
        for exp in rows["skip"]:
            print(
                f"vitexp-sweep: {exp} ({kind}) has a completed or running run; skipped (--force reruns it)",
                file=sys.stderr,
            )
        if rows["launch"]:
            launch[kind] = rows["launch"]
            grouping = [
                f"++logger.group={spec['name']}",
                f"++logger.tags=[{spec['name']}]",
            ]  # ++: any logger group
            commands += [
                (kind, [_script(APPS[kind]), "-m", *job, *grouping, *args.overrides])
                for job in job_list(rows)
            ]
    if args.dry_run:  # nothing ran: what would run, and the commands that would run it
        for _, cmd in commands:
            print("vitexp-sweep: " + " ".join(cmd), file=sys.stderr)
        print(
            json.dumps(
                {
                    "table": spec["name"],
                    "status": "dry_run",
                    "would_launch": launch,
                    "skipped": skipped,
                    "commands": [" ".join([APPS[kind], *cmd[1:]]) for kind, cmd in commands],
                }
            )
        )  # no machine path
        return 0
    summary = {"table": spec["name"], "launched": launch, "skipped": skipped, "returncodes": {}}
    status = 0
    for kind, cmd in commands:
        print("vitexp-sweep: " + " ".join(cmd), file=sys.stderr, flush=True)
        rc = subprocess.run(cmd).returncode
        summary["returncodes"][kind] = summary["returncodes"].get(kind) or rc
        status = status or rc
    if "train" in launch:
        summary["kept"] = keep_starts(spec, results_dir)
        _report_kept(summary["kept"])
    summary["status"] = "completed" if status == 0 else "failed"
    print(json.dumps(summary))
    return status
