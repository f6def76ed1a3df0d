"""``vitexp-sweep TABLE``: launch every row of a table spec as one Hydra multirun.

Rows are experiment configs (``conf/experiment/<row.experiment>.yaml``); a row's ``run`` says
which app produces it (``train`` -> vitexp-train, ``flops`` -> vitexp-flops, ``bench`` ->
vitexp-bench). Rows that already have a completed run of that kind in the ledger, or one running
now, are skipped unless ``--force``, so an interrupted sweep resumes by running the same command
again; a run whose process is gone (``interrupted``, :func:`vitexp.results.effective_status`) is rerun.
A row with seeds (the spec's ``seeds``, :mod:`vitexp.aggregate`) is one job per seed (``experiment=E
seed=s``, recorded as ``E+seed=s``), and only its seeds without a completed or running run are
launched; unseeded rows go first (the pretrained baselines that seeded rows load with ``run:``).
Every job's W&B run is grouped and tagged by the table (``logger.group``, ``logger.tags``).
Extra arguments are Hydra overrides passed to every job, e.g. ``hydra/launcher=slurm
trainer=ddp data.root=/datasets/imagenet``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from vitexp import CONF_DIR
from vitexp.aggregate import row_seeds, seed_runs, seeded_name
from vitexp.results import default_results_dir, effective_status, iter_runs
from vitexp.tables import all_specs, load_spec

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


def plan(spec: dict, kind: str | None, force: bool, results_dir: Path) -> dict[str, dict]:
    """{kind: {"launch": [names], "skip": [names], "seeds": {experiment: [seeds to launch]},
    "seeded": [names of seeded jobs]}} for the spec's runnable rows; a name is the experiment, or
    ``<experiment>+seed=<s>`` for one seed of a seeded row."""
    out: dict[str, dict] = {}
    for row in spec["rows"]:
        if row.get("cited") or not row.get("experiment"):
            continue
        exp = row["experiment"]
        if not (CONF_DIR / "experiment" / f"{exp}.yaml").is_file():
            raise FileNotFoundError(f"row {row['label']!r}: no experiment config conf/experiment/{exp}.yaml")
        k = kind or row.get("run", "train")
        if k not in APPS:
            raise ValueError(f"row {row['label']!r}: run {k!r} is not one of {sorted(APPS)}")
        bucket = out.setdefault(k, {"launch": [], "skip": [], "seeds": {}, "seeded": []})
        active = [r for r in iter_runs(results_dir)
                  if r.get("kind") == k and effective_status(r) in ("completed", "running")]
        seeds = row_seeds(spec, row)
        if seeds is not None:
            by_seed = seed_runs([{**r, "status": "completed"} for r in active], exp, seeds)
            for seed in seeds:
                target = "skip" if by_seed[seed] and not force else "launch"
                if seeded_name(exp, seed) not in bucket[target]:
                    bucket[target].append(seeded_name(exp, seed))
                    bucket["seeded"].append(seeded_name(exp, seed))
                    if target == "launch":
                        bucket["seeds"].setdefault(exp, []).append(seed)
            continue
        target = "skip" if any(r.get("experiment") == exp for r in active) and not force else "launch"
        if exp not in bucket[target]:
            bucket[target].append(exp)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vitexp-sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("table", help=f"a table spec in sweeps/: {all_specs()}")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every job")
    parser.add_argument("--force", action="store_true", help="rerun rows that already have a completed run")
    parser.add_argument("--kind", choices=sorted(APPS), help="launch this app for every row instead of each row's own")
    parser.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    args = parser.parse_intermixed_args(argv)
    try:
        spec = load_spec(args.table)
        results_dir = default_results_dir()
        for ov in args.overrides:
            if ov.startswith("results_dir="):
                results_dir = Path(ov.split("=", 1)[1])
        todo = plan(spec, args.kind, args.force, results_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"vitexp-sweep: {err}", file=sys.stderr)
        print(json.dumps({"status": "failed", "error": str(err)}))
        return 2
    summary = {"table": spec["name"], "launched": {}, "skipped": {}, "returncodes": {}}
    status = 0
    for kind, rows in todo.items():
        summary["skipped"][kind] = rows["skip"]
        for exp in rows["skip"]:
            print(f"vitexp-sweep: {exp} ({kind}) has a completed or running run; skipped (--force reruns it)", file=sys.stderr)
        if not rows["launch"]:
            continue
        unseeded = [e for e in rows["launch"] if e not in rows["seeded"]]
        jobs = [[f"experiment={','.join(unseeded)}"]] if unseeded else []
        jobs += [[f"experiment={exp}", f"seed={','.join(map(str, seeds))}"] for exp, seeds in rows["seeds"].items()]
        grouping = [f"++logger.group={spec['name']}", f"++logger.tags=[{spec['name']}]"]  # ++: any logger group
        summary["launched"][kind] = rows["launch"]
        for job in jobs:
            cmd = [_script(APPS[kind]), "-m", *job, *grouping, *args.overrides]
            print("vitexp-sweep: " + " ".join(cmd), file=sys.stderr, flush=True)
            if args.dry_run:
                continue
            rc = subprocess.run(cmd).returncode
            summary["returncodes"][kind] = summary["returncodes"].get(kind) or rc
            status = status or rc
    summary["status"] = "completed" if status == 0 else "failed"
    print(json.dumps(summary))
    return status
