"""Where a ledger is read from: a results folder (``<root>/runs/*.json``), a snapshot file, or a W&B
project; and how a snapshot is written.

Decisions:
- Results off ``main``'s history, tables on it: the run entries of a project live in the results
  root ``$VITEXP_RESULTS`` (default ``results/`` of the checkout), completed ones folded into
  compressed packs (:mod:`vitexp.ledger.packs`); a release can ship one snapshot
  (:func:`write_snapshot`: every entry exactly as written, key order kept, one JSON object a line,
  sorted by run id, gzip'ed), from which ``vitexp-tables --ledger <snapshot>`` regenerates the
  committed tables byte for byte. A team may keep its runs in any folder or on a ``results``
  branch checked out as a worktree (``export VITEXP_RESULTS=../vitexp-results``).
- Every entry is checked against :mod:`vitexp.ledger.schema` as it is read; a file that does not
  parse or breaks the schema is kept aside as a :class:`~vitexp.ledger.schema.BrokenEntry`, never
  skipped in silence.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterable

from vitexp.ledger.schema import BrokenEntry, problems

SNAPSHOT_SUFFIXES = (".jsonl", ".jsonl.gz")


def is_snapshot(path: Path | str) -> bool:
    return str(path).endswith(SNAPSHOT_SUFFIXES)


def check(record: Any, where: str, stem: str | None = None) -> tuple[dict[str, Any] | None, BrokenEntry | None]:
    """(record, None) when ``record`` keeps the schema, else (None, the broken entry)."""
    wrong = problems(record, stem)
    if wrong:
        return None, BrokenEntry(where, "; ".join(wrong), record if isinstance(record, dict) else None)
    return record, None


def read_folder(runs_dir: Path) -> tuple[list[dict[str, Any]], list[BrokenEntry]]:
    """Every ``*.json`` of ``runs_dir`` but hidden files (:func:`vitexp.ledger.paths.atomic_write`'s
    ``.<name>.XXXX.json`` before its rename), checked; (records, broken)."""
    records, broken = [], []
    for file in sorted(runs_dir.glob("*.json")) if runs_dir.is_dir() else ():
        if file.name.startswith("."):  # atomic_write's temporary file, mid-write or orphaned by a kill
            continue
        where = f"{runs_dir.name}/{file.name}"
        try:
            record = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError) as err:
            broken.append(BrokenEntry(where, f"unreadable ({type(err).__name__}: {err.strerror or err})"))
            continue
        except json.JSONDecodeError as err:
            broken.append(BrokenEntry(where, f"not JSON ({err.msg} at line {err.lineno}, column {err.colno}: "
                                             "a truncated copy or a merge conflict?)"))
            continue
        good, bad = check(record, where, file.stem)
        records += [good] if good else []
        broken += [bad] if bad else []
    return records, broken


def read_snapshot(path: Path) -> tuple[list[dict[str, Any]], list[BrokenEntry]]:
    """The entries of a snapshot file (one JSON object a line, gzip'ed when it ends ``.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    records, broken = [], []
    with opener(path, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{Path(path).name}:{i}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                broken.append(BrokenEntry(where, f"not JSON ({err.msg})"))
                continue
            good, bad = check(record, where)
            records += [good] if good else []
            broken += [bad] if bad else []
    return records, broken


def write_snapshot(records: Iterable[dict[str, Any]], path: Path) -> Path:
    """Write ``records`` as a snapshot (module docstring) through an atomic write."""
    from vitexp.ledger.paths import atomic_write, json_default

    lines = "".join(json.dumps(r, separators=(",", ":"), default=json_default) + "\n"
                    for r in sorted(records, key=lambda r: r["run_id"]))
    data = gzip.compress(lines.encode(), mtime=0) if str(path).endswith(".gz") else lines.encode()
    return atomic_write(path, data)


WANDB_STATES = {"finished": "completed", "crashed": "failed", "failed": "failed", "killed": "interrupted",
                "preempted": "interrupted", "preempting": "running"}


def read_wandb(path: str) -> tuple[list[dict[str, Any]], list[BrokenEntry]]:
    """Runs of a W&B project (``ENTITY/PROJECT``) as ledger records, checked like files."""
    import wandb

    records, broken = [], []
    for run in wandb.Api().runs(path):
        config = dict(run.config)
        summary = {k: v for k, v in dict(run.summary).items() if not k.startswith("_")}
        record = {
            "run_id": run.id, "experiment": config.get("name", run.name),
            "status": WANDB_STATES.get(run.state, run.state), "kind": getattr(run, "job_type", None) or "train",
            "config": config,  # its seed places the run in a seeded row
            "metrics": summary, "started": str(getattr(run, "created_at", "")), "wandb_url": getattr(run, "url", None),
        }
        if config.get("fingerprint"):
            record["fingerprint"] = config["fingerprint"]
        good, bad = check(record, f"W&B run {path}/{run.id}")
        records += [good] if good else []
        broken += [bad] if bad else []
    return records, broken
