"""Where a ledger is read from: a results folder (``<root>/runs/*.json``), a snapshot file, or a W&B
project; and how a snapshot is written.

Its reasoning: docs/ledger.md, "vitexp/ledger/sources.py".
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from vitexp.ledger.paths import portable_paths
from vitexp.ledger.schema import BrokenEntry, problems

SNAPSHOT_SUFFIXES = (".jsonl", ".jsonl.gz")


def is_snapshot(path: Path | str) -> bool:
    return str(path).endswith(SNAPSHOT_SUFFIXES)


def check(
    record: Any, where: str, stem: str | None = None
) -> tuple[dict[str, Any] | None, BrokenEntry | None]:
    """(record, None) when ``record`` keeps the schema, else (None, the broken entry)."""
    wrong = problems(record, stem)
    if wrong:
        return None, BrokenEntry(where, "; ".join(wrong), record if isinstance(record, dict) else None)
    return record, None


def salvage(text: str) -> dict[str, Any] | None:
    """What a file that does not parse as a whole still says: its ``experiment`` and ``kind`` (as
    written, before the config) and its ``config`` when that object is whole; ``None`` when none."""
    found: dict[str, Any] = {}
    for key in ("run_id", "experiment", "kind"):
        match = re.search(rf'"{key}"\s*:\s*"((?:[^"\\]|\\.)*)"', text)
        if match:
            try:
                found[key] = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                pass
    match = re.search(r'"config"\s*:\s*', text)
    if match:
        try:
            config, _ = json.JSONDecoder().raw_decode(text, match.end())
        except json.JSONDecodeError:
            config = None
        if isinstance(config, dict):
            found["config"] = config
    return found or None


def _not_json(where: str, text: str, err: json.JSONDecodeError, hint: str = "") -> BrokenEntry:
    return BrokenEntry(
        where, f"not JSON ({err.msg} at line {err.lineno}, column {err.colno}{hint})", salvage(text)
    )


def read_folder(runs_dir: Path) -> tuple[list[dict[str, Any]], list[BrokenEntry]]:
    """Every ``*.json`` of ``runs_dir`` but hidden files (:func:`vitexp.ledger.paths.atomic_write`'s
    ``.<name>.XXXX.json`` before its rename), checked; (records, broken)."""
    records, broken = [], []
    for file in sorted(runs_dir.glob("*.json")) if runs_dir.is_dir() else ():
        if file.name.startswith("."):  # atomic_write's temporary file, mid-write or orphaned by a kill
            continue
        where = f"{runs_dir.name}/{file.name}"
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:  # removed since the listing (a pack folded it)
            continue
        except (OSError, UnicodeDecodeError) as err:
            broken.append(
                BrokenEntry(
                    where, f"unreadable ({type(err).__name__}: {getattr(err, 'strerror', None) or err})"
                )
            )
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            broken.append(_not_json(where, text, err, ": a truncated copy or a merge conflict?"))
            continue
        good, bad = check(record, where, file.stem)
        records += [good] if good else []
        broken += [bad] if bad else []
    return records, broken


#: What reading a compressed or text file to its end raises when it is truncated, not gzip or not UTF-8.
UNREADABLE = (OSError, EOFError, zlib.error, UnicodeDecodeError)


def read_snapshot(path: Path, where: str | None = None) -> tuple[list[dict[str, Any]], list[BrokenEntry]]:
    """The entries of a snapshot file (one JSON object a line, gzip'ed when it ends ``.gz``), each
    broken one named ``<where>:<line>`` (``where``: how the file is named, default its name). A file
    that cannot be read to its end is one broken entry, and none of its entries is read."""
    where = where or Path(path).name
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            lines = fh.read().split("\n")
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no such snapshot file") from None
    except UNREADABLE as err:
        kind = "truncated" if isinstance(err, EOFError) else "unreadable"
        return [], [BrokenEntry(where, f"{kind} ({type(err).__name__}: {err}): none of its entries was read")]
    records, broken = [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            broken.append(BrokenEntry(f"{where}:{i}", f"not JSON ({err.msg})", salvage(line)))
            continue
        good, bad = check(record, f"{where}:{i}")
        records += [good] if good else []
        broken += [bad] if bad else []
    return records, broken


def write_snapshot(records: Iterable[dict[str, Any]], path: Path) -> Path:
    """Write ``records`` as a snapshot (module docstring) through an atomic write."""
    from vitexp.ledger.paths import atomic_write, json_default

    lines = "".join(
        json.dumps(r, separators=(",", ":"), default=json_default, allow_nan=False) + "\n"
        for r in sorted(records, key=lambda r: r["run_id"])
    )
    data = gzip.compress(lines.encode(), mtime=0) if str(path).endswith(".gz") else lines.encode()
    return atomic_write(path, data)


WANDB_STATES = {
    "finished": "completed",
    "crashed": "failed",
    "failed": "failed",
    "killed": "interrupted",
    "preempted": "interrupted",
    "preempting": "running",
}


def _zoned(stamp: Any) -> str:
    """W&B's ``created_at`` (UTC, naming no zone) as the ledger's time, ``+00:00``."""
    text = str(stamp or "")
    try:
        then = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return text
    return (then if then.tzinfo else then.replace(tzinfo=timezone.utc)).isoformat()


class WandbError(RuntimeError):
    """A W&B project that cannot be listed (no login, no network, no such project)."""


def read_wandb(path: str) -> tuple[list[dict[str, Any]], list[BrokenEntry]]:
    """Runs of a W&B project (``ENTITY/PROJECT``) as ledger records, checked like files: each
    fingerprinted from its config like any entry without one (:func:`vitexp.ledger.fingerprint.of_record`)."""
    import wandb

    try:
        runs = list(wandb.Api().runs(path))
    except Exception as err:  # noqa: BLE001 - wandb raises its own types, and requests' and OSError
        raise WandbError(f"W&B {path}: {type(err).__name__}: {err}") from None
    records, broken = [], []
    for run in runs:
        where = f"W&B run {path}/{getattr(run, 'id', '?')}"
        try:
            config = dict(run.config)
            summary = {k: v for k, v in dict(run.summary).items() if not k.startswith("_")}
            record = {
                "run_id": run.id,
                "experiment": config.get("name", run.name),
                "status": WANDB_STATES.get(run.state, run.state),
                "kind": getattr(run, "job_type", None) or "train",
                "config": (
                    config
                ),  # its seed places the run in a seeded row; its fingerprint is computed from it
                "metrics": summary,
                "started": _zoned(getattr(run, "created_at", None)),
                "wandb_url": getattr(run, "url", None),
            }
        except Exception as err:  # noqa: BLE001 - one run W&B cannot give back: named, never skipped
            broken.append(BrokenEntry(where, f"unreadable ({type(err).__name__}: {err})"))
            continue
        if config.get("fingerprint"):
            record["fingerprint"] = config["fingerprint"]
        # the config as the run logged it: its paths are its machine's (W&B's host, when it says)
        record = portable_paths(record, host=str(getattr(run, "host", None) or "wandb-run"))
        good, bad = check(record, where)
        records += [good] if good else []
        broken += [bad] if bad else []
    return records, broken
