"""``vitexp-rebuild``: rerun a ‡ run at its recorded commit, to decide whether its code can be rebuilt from
the repository.

Its reasoning: docs/commands.md, "vitexp/commands/rebuild.py".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

from vitexp import PROJECT_ROOT
from vitexp.ledger import Ledger, LedgerEntry, copy_entry, default_results_dir, marks
from vitexp.ledger import fingerprint as fp

REBUILD_KIND, REBUILD_NAME = "rebuild", "rebuild_check"
#: The command-line entry point of each kind at every commit the ledger records.
ENTRY_POINTS = {"train": "train_main", "flops": "flops_main"}
#: Metrics a rerun is not expected to repeat: how long it took and on what machine.
UNTIMED = ("time", "throughput", "latency", "speedup", "load")
#: What the rerun's process is given: one thread, as the tier's runs had; W&B offline.
RERUN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline"}
#: Folders of the checkout that hold run weights a pinned start points to (ignored by git).
WEIGHT_FOLDERS = ("outputs", "multirun")


def arguments(run: Mapping[str, Any]) -> list[str]:
    """The command-line overrides of ``run``'s own command (module docstring)."""
    name = str(run["experiment"])
    base, _, rest = name.partition("+")
    args = [f"experiment={base}"]
    if rest.startswith("seed="):
        args.append(rest)
    pretrained = str(((run.get("config") or {}).get("backbone") or {}).get("pretrained") or "")
    if pretrained.startswith(fp.RUN_PREFIX):
        args.append(f"backbone.pretrained={pretrained}")
    return [*args, "logger=none", "trainer.enable_progress_bar=false"]


def _hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (strings quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


#: Groups whose option a recorded config names: (group, the key holding the option's name).
GROUP_NAMES = (
    ("backbone", "name"),
    ("method", "name"),
    ("budget", "kind"),
    ("data", "name"),
    ("recipe", "name"),
)


def config_arguments(run: Mapping[str, Any]) -> list[str]:
    """The command of a run launched with overrides under a ``name=`` (no experiment file of its
    name at its commit): its groups' options, then every recorded leaf that the fingerprint keeps
    (``++key=value``); the comparison of the rerun's config with the recorded one checks the result."""
    config = run.get("config") or {}
    args = [
        f"{group}={(config.get(group) or {}).get(key)}"
        for group, key in GROUP_NAMES
        if (config.get(group) or {}).get(key) is not None
    ]
    args += [f"++{k}={_hydra_value(v)}" for k, v in fp.leaves(config).items() if not fp.excluded(k)]
    return [*args, f"name={_hydra_value(str(run['experiment']))}", "logger=none"]


def _has_experiment(commit: str, run: Mapping[str, Any]) -> bool:
    base = str(run["experiment"]).partition("+")[0]
    return (
        subprocess.run(
            ["git", "cat-file", "-e", f"{commit}:conf/experiment/{base}.yaml"],
            cwd=PROJECT_ROOT,
            capture_output=True,
        ).returncode
        == 0
    )


def compared(original: Mapping[str, Any], rerun: Mapping[str, Any]) -> tuple[int, list[str]]:
    """(how many values were compared, what differs): every metric of ``original`` but the timings,
    the weights' sha256 when both recorded one, and the configuration."""
    differences, n = [], 0
    for key, value in sorted((original.get("metrics") or {}).items()):
        if any(t in key for t in UNTIMED):
            continue
        n += 1
        if (rerun.get("metrics") or {}).get(key) != value:
            differences.append(
                f"metrics.{key}: {value!r} recorded, {(rerun.get('metrics') or {}).get(key)!r} rebuilt"
            )
    sha = [(r.get("artifacts") or {}).get("weights_sha256") for r in (original, rerun)]
    if all(sha):
        n += 1
        if sha[0] != sha[1]:
            differences.append("artifacts.weights_sha256 differs")
    keys = fp.differences(original.get("config") or {}, rerun.get("config") or {}) + fp.differences(
        rerun.get("config") or {}, original.get("config") or {}
    )
    differences += [f"config.{k} differs" for k in sorted(set(keys))]
    return n, differences


def _checkout(commit: str, scratch: Path) -> Path:
    """A clean, detached checkout of ``commit`` under ``scratch`` (one per commit), with this
    checkout's weight folders linked into it."""
    tree = scratch / commit[:12]
    if not tree.is_dir():
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--force", str(tree), commit],
            cwd=PROJECT_ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        for folder in WEIGHT_FOLDERS:
            if (PROJECT_ROOT / folder).is_dir():
                (tree / folder).symlink_to(PROJECT_ROOT / folder)
    return tree


def _remove_checkouts(scratch: Path) -> None:
    for tree in scratch.iterdir() if scratch.is_dir() else ():
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(tree)], cwd=PROJECT_ROOT, capture_output=True
        )


def cli_module(tree: Path) -> str:
    """The console scripts' module in a checkout of ``tree``'s commit: ``vitexp.commands.cli`` since the
    package layout (docs/layout.md), ``vitexp.cli`` at the commits before it."""
    return (
        "vitexp.commands.cli" if (Path(tree) / "vitexp" / "commands" / "cli.py").is_file() else "vitexp.cli"
    )


def rerun(run: Mapping[str, Any], ledger: Ledger, scratch: Path) -> tuple[dict[str, Any] | None, str]:
    """Run ``run``'s command at its recorded commit; (the rerun's entry or ``None``, the output's tail)."""
    commit = (run.get("env") or {}).get("git_commit")
    tree = _checkout(commit, scratch)
    results = scratch / f"results-{run['run_id']}"
    pinned = str(((run.get("config") or {}).get("backbone") or {}).get("pretrained") or "").removeprefix(
        fp.RUN_PREFIX
    )
    start = ledger.get(pinned) if pinned else None
    if start is not None:
        copy_entry(start, results)
    own = arguments(run) if _has_experiment(commit, run) else config_arguments(run)
    args = [*own, f"hydra.run.dir={scratch / ('out-' + run['run_id'])}"]
    code = (
        f"import sys; from {cli_module(tree)} import {ENTRY_POINTS[run['kind']]} as main; "
        f"sys.argv = ['vitexp-{run['kind']}', *{args!r}]; main()"
    )
    env = {**os.environ, **RERUN_ENV, "PYTHONPATH": str(tree), "VITEXP_RESULTS": str(results)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    entries = [e for e in Ledger.load(results) if e.get("run_id") != pinned] if results.is_dir() else []
    made = [e for e in entries if e.get("kind") == run["kind"] and e.get("status") == "completed"]
    errors = [
        line for line in (done.stdout + done.stderr).splitlines() if "rror" in line or "invalid" in line
    ]
    return (made[-1] if made else None), "\n".join(errors[-3:]) or (done.stdout + done.stderr)[-600:]


def check(run: Mapping[str, Any], ledger: Ledger, scratch: Path, results_dir: Path) -> dict[str, Any]:
    """Rebuild ``run`` and record the verdict as a ``rebuild`` ledger entry; its record."""
    if run["kind"] not in ENTRY_POINTS:
        n, differences, made, tail = 0, [f"a {run['kind']} run: nothing deterministic to compare"], None, ""
    else:
        made, tail = rerun(run, ledger, scratch)
        n, differences = (
            compared(run, made) if made else (0, ["the rerun did not complete: " + tail.strip()[-400:]])
        )
    config = {
        "rebuilds": run["run_id"],
        "commit": (run.get("env") or {}).get("git_commit"),
        "arguments": (
            arguments(run)
            if _has_experiment((run.get("env") or {}).get("git_commit"), run)
            else config_arguments(run)
        ),
    }
    entry = LedgerEntry(REBUILD_NAME, REBUILD_KIND, config, results_dir).start()
    entry.finish(
        {"compared": n, "differing": len(differences)},
        {"rule": "every untimed metric equal (vitexp.commands.rebuild)"},
        rebuilds=run["run_id"],
        rebuilt=bool(made) and n > 0 and not differences,
        differences=differences,
    )
    return entry.record


def marked_runs(ledger: Ledger, table_names: Iterable[str]) -> list[dict[str, Any]]:
    """The runs behind the ‡ cells of ``table_names``, each once, in run-id order."""
    from vitexp.report import tables

    found: dict[str, dict[str, Any]] = {}
    for name in table_names:
        for row in tables.fill(tables.load_spec(name), ledger):
            for cell in row["cells"].values():
                if marks.NO_DIFF in (cell.get("marks") or ""):
                    for rid in cell.get("run_ids") or [cell.get("run_id")]:
                        run = ledger.get(rid) if rid else None
                        if run is not None and marks.diff_missing(run):
                            found[rid] = run
    return [found[k] for k in sorted(found)]


def main(argv: list[str] | None = None) -> int:
    from vitexp.report import tables

    parser = argparse.ArgumentParser(prog="vitexp-rebuild", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="run ids to rebuild (default: every ‡ run of --tables)")
    parser.add_argument(
        "--tables", nargs="*", default=None, help="the tables whose ‡ runs to rebuild (default: all)"
    )
    parser.add_argument("--kind", choices=sorted(ENTRY_POINTS), default=None, help="only runs of this kind")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--again", action="store_true", help="also runs that already have a rebuild entry")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their commands only")
    args = parser.parse_args(argv)
    results_dir = args.results_dir or default_results_dir()
    ledger = Ledger.load(results_dir)
    runs = (
        [ledger.get(r) for r in args.runs]
        if args.runs
        else marked_runs(ledger, args.tables or tables.all_specs())
    )
    unknown = [r for r, run in zip(args.runs, runs) if run is None] if args.runs else []
    if unknown:
        parser.error(f"no ledger entry {unknown[0]} in {results_dir}")
    checked = {r.get("rebuilds") for r in ledger.records if r["kind"] == REBUILD_KIND}
    runs = [
        r for r in runs if (args.kind in (None, r["kind"])) and (args.again or r["run_id"] not in checked)
    ]
    for run in runs:
        print(
            f"{run['run_id']} @ {(run.get('env') or {}).get('git_commit', '')[:7]}:"
            f" {' '.join(arguments(run))}"
        )
    if args.dry_run:
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="vitexp-rebuild-"))
    try:
        for run in runs:
            record = check(run, ledger, scratch, results_dir)
            print(
                json.dumps(
                    {
                        "rebuilds": run["run_id"],
                        "rebuilt": record["rebuilt"],
                        "differences": record["differences"][:3],
                    }
                ),
                flush=True,
            )
    finally:
        _remove_checkouts(scratch)
    return 0


def main_exit() -> None:
    """The ``vitexp-rebuild`` console script."""
    raise SystemExit(main())


if __name__ == "__main__":
    main_exit()
