"""``vitexp-sweep TABLE --rehearse``: every row of a table at full size, for a few optimiser steps.

``vitexp-sweep TABLE --rehearse``: every row of a table at full size, for a few optimiser steps, before
any cluster time is spent on it.

Its reasoning: docs/cluster.md, "vitexp/cost/rehearsal/__init__.py".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from vitexp.cost.rehearsal.plan import (
    DEVICES,
    KIND,
    SUFFIX,
    Job,
    Settings,
    rehearsal_jobs,
    rehearsal_overrides,
)

__all__ = [
    "KIND",
    "Settings",
    "Job",
    "rehearsal_jobs",
    "rehearsal_overrides",
    "rehearse_table",
    "add_arguments",
    "settings_from",
    "only_from",
]

#: Seconds a row may run before it is killed and recorded failed.
DEFAULT_TIMEOUT_S = 3600


def add_arguments(parser) -> None:
    """``vitexp-sweep``'s rehearsal options."""
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="rehearse every row at full size on synthetic data for a few steps (ledger kind rehearsal)",
    )
    parser.add_argument(
        "--rehearse-batch",
        type=int,
        default=None,
        help="per-device batch of a rehearsal (0: the recipe's; default 2 on the CPU, the recipe's on a GPU)",
    )
    parser.add_argument(
        "--rehearse-steps",
        type=int,
        default=3,
        help="optimiser steps per stage (the first is counted, not timed)",
    )
    parser.add_argument(
        "--rehearse-trainer",
        choices=sorted(DEVICES),
        default=None,
        help=(
            "trainer group of a rehearsal (default: gpu when CUDA is available, else cpu); ddp_cpu: 2 gloo"
            " processes"
        ),
    )
    parser.add_argument(
        "--rehearse-dir",
        type=Path,
        default=Path("outputs") / "rehearsal",
        help="where each row's run folder and log go",
    )
    parser.add_argument(
        "--rehearse-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before a row is killed"
    )
    parser.add_argument(
        "--rehearse-only",
        default=None,
        metavar="NAME,...",
        help="rehearse only the rows recorded under these names (default: every row)",
    )
    parser.add_argument(
        "--rehearse-budget-s",
        type=float,
        default=None,
        help=(
            "start no row that could not end (--rehearse-timeout) inside this many seconds; the rows "
            "not reached are listed (status partial)"
        ),
    )


def settings_from(args) -> Settings:
    import torch

    trainer = args.rehearse_trainer or ("gpu" if torch.cuda.is_available() else "cpu")
    on_cpu = trainer in ("cpu", "ddp_cpu")
    batch = args.rehearse_batch if args.rehearse_batch is not None else (2 if on_cpu else 0)
    return Settings(batch=batch or None, steps=args.rehearse_steps, trainer=trainer)


def only_from(args) -> list[str] | None:
    """``--rehearse-only a,b``: the row names, or ``None`` for every row."""
    return [n.strip() for n in args.rehearse_only.split(",") if n.strip()] if args.rehearse_only else None


def _closing_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _record_failure(job: Job, error: str, results_dir: Path, run_dir: Path, since: str) -> str:
    """Close the row's own entry ``failed`` (a process killed while its entry was running), or write
    a failed entry for a row that never opened one; returns the run id."""
    from vitexp.ledger import Ledger, LedgerEntry, portable_text

    error = portable_text(error, results_dir)  # no machine path in the ledger
    for record in reversed(Ledger.load(results_dir).named(job.name)):
        if (
            record["kind"] == KIND
            and record["status"] == "running"
            and (record.get("started") or "") >= since
        ):
            entry = LedgerEntry.load(record["run_id"], results_dir)
            entry.fail(RuntimeError(error))
            return record["run_id"]
    entry = LedgerEntry(job.name, KIND, config=job.config, results_dir=results_dir, run_dir=run_dir).start()
    entry.fail(RuntimeError(error))
    return entry.run_id


def _run_row(job: Job, results_dir: Path, run_dir: Path, timeout: float) -> dict[str, Any]:
    """Rehearse one row in its own process; {status, run_id, metrics, error}."""
    from vitexp.ledger.status import now

    since = now()
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VITEXP_RESULTS": str(results_dir)}
    cmd = [sys.executable, "-m", "vitexp.commands.rehearse_main", *job.arguments, f"hydra.run.dir={run_dir}"]
    closing, error = None, None
    with open(run_dir / "rehearsal.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            done = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, timeout=timeout
            )
            log.write(done.stdout)
            closing = _closing_line(done.stdout)
            if closing is None:
                error = (
                    f"the process ended with code {done.returncode} and no closing line (see"
                    f" {run_dir / 'rehearsal.log'})"
                )
        except subprocess.TimeoutExpired as err:
            log.write((err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""))
            error = f"timed out after {timeout:.0f} s"
    for leftover in ("weights.pth", "checkpoints"):  # random weights; GBs of checkpoints at full size
        path = run_dir / leftover
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    if closing is not None and closing.get("ledger"):
        return {
            "status": closing.get("status"),
            "run_id": closing.get("run_id") or Path(closing["ledger"]).stem,
            "metrics": closing.get("metrics") or {},
            "error": closing.get("error"),
        }
    error = error or (closing or {}).get("error") or "no ledger entry"
    return {
        "status": "failed",
        "run_id": _record_failure(job, error, results_dir, run_dir, since),
        "metrics": {},
        "error": error,
    }


def _already(job: Job, settings: Settings, ledger) -> str | None:
    """The id of a completed rehearsal of the job's configuration on this kind of device, if any."""
    from vitexp.config.rows import composed_config
    from vitexp.ledger import fingerprint as fp

    config = composed_config([a for a in job.arguments if not a.startswith(("name=", "results_dir="))], None)
    if config is None:
        return None
    want = fp.fingerprint(config)
    cuda = settings.trainer in ("gpu", "ddp")
    for record in reversed(ledger.named(job.name)):
        device = str((record.get("metrics") or {}).get("device") or "")
        if (
            record["kind"] == KIND
            and record["status"] == "completed"
            and fp.of_record(record) == want
            and device.startswith("cuda") == cuda
        ):
            return record["run_id"]
    return None


def _line(name: str, result: dict[str, Any]) -> str:
    m = result.get("metrics") or {}
    if result["status"] != "completed":
        return f"rehearsal {name}: {result['status']}: {result.get('error')}"
    step = m.get("step_s")
    ips = m.get("images_per_s")
    return (
        f"rehearsal {name}: completed, {step:.3f} s/step, {ips:.2f} images/s"
        if step and ips
        else f"rehearsal {name}: completed, no timed step"
    ) + f", peak RSS {m.get('peak_rss_mb', 0):.0f} MiB (batch {m.get('batch_size')}, {m.get('device')})"


def rehearse_table(
    spec: dict[str, Any],
    settings: Settings,
    results_dir: Path,
    out_dir: Path,
    overrides: Sequence[str] = (),
    force: bool = False,
    dry_run: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
    only: Sequence[str] | None = None,
    budget_s: float | None = None,
) -> dict[str, Any]:
    """Rehearse every runnable row of ``spec`` (module docstring), or those whose ledger names are in
    ``only``; no row starts that could not end inside ``budget_s`` seconds, each row's worst case being
    ``timeout`` (those left are ``not_reached``, status ``partial``). Returns the closing line's object."""
    from vitexp.ledger import Ledger
    from vitexp.ledger.entry import short_name

    start = time.monotonic()
    overrides = [ov for ov in overrides if not ov.startswith("results_dir=")]
    jobs = rehearsal_jobs(spec, settings, overrides)
    if only is not None:
        unknown = sorted(set(only) - {j.name.removesuffix(SUFFIX) for j in jobs})
        if unknown:
            raise ValueError(
                f"--rehearse-only: {unknown} are not rows of {spec['name']}:"
                f" {[j.name.removesuffix(SUFFIX) for j in jobs]}"
            )
        jobs = [j for j in jobs if j.name.removesuffix(SUFFIX) in only]
    ledger = Ledger.load(results_dir)
    summary: dict[str, Any] = {
        "table": spec["name"],
        "kind": KIND,
        "trainer": settings.trainer,
        "batch": settings.batch or "recipe",
        "steps": settings.steps,
        "rows": {},
        "skipped": {},
        "failed": [],
        "not_reached": [],
    }
    for job in jobs:
        if (
            budget_s is not None and budget_s - (time.monotonic() - start) < timeout and not dry_run
        ):  # its worst case
            summary["not_reached"].append(job.name)
            continue
        done = None if force or job.config is None else _already(job, settings, ledger)
        if done:
            summary["skipped"][job.name] = done
            print(
                f"vitexp-sweep: rehearsal {job.name}: done already ({done}); --force rehearses it again",
                file=sys.stderr,
            )
            continue
        if dry_run:
            summary["rows"][job.name] = "python -m vitexp.commands.rehearse_main " + " ".join(job.arguments)
            continue
        if job.config is None:
            from vitexp.ledger import LedgerEntry

            entry = LedgerEntry(job.name, KIND, results_dir=results_dir).start()
            entry.fail(RuntimeError(job.error))
            result = {"status": "failed", "run_id": entry.run_id, "metrics": {}, "error": job.error}
        else:
            run_dir = out_dir / spec["name"] / short_name(job.name) / time.strftime("%Y%m%d-%H%M%S")
            result = _run_row(job, results_dir, run_dir, timeout)
        print(f"vitexp-sweep: {_line(job.name, result)}", file=sys.stderr, flush=True)
        summary["rows"][job.name] = {k: result[k] for k in ("status", "run_id")}
        if result["status"] != "completed":
            summary["failed"].append(job.name)
    summary["status"] = (
        "dry_run"
        if dry_run
        else "failed"
        if summary["failed"]
        else "partial"
        if summary["not_reached"]
        else "completed"
    )
    return summary
