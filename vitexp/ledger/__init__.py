"""The ledger: the one reader and writer of results.

Nothing outside this package opens a run's entry; commands, tables and methods receive records from a
:class:`Ledger` or write through a :class:`LedgerEntry`.

Its reasoning: docs/ledger.md, "vitexp/ledger/__init__.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitexp.ledger.entry import LedgerEntry, environment, machine_load, new_run_id
from vitexp.ledger.index import Ledger, RowQuery, run_seed, seeded_name
from vitexp.ledger.kept import KeptWeightsError, keep, kept_path, sha256, weights_file
from vitexp.ledger.paths import (
    atomic_write,
    atomic_write_json,
    default_results_dir,
    local_path,
    portable_path,
    portable_paths,
    portable_text,
)
from vitexp.ledger.schema import FINAL_STATUSES, KINDS, STATUSES, BrokenEntry, LedgerError
from vitexp.ledger.status import INTERRUPTED, STALE_HOURS, effective_status

RUN_WEIGHTS_PREFIX = "run:"

__all__ = [
    "Ledger",
    "LedgerEntry",
    "LedgerError",
    "BrokenEntry",
    "RowQuery",
    "INTERRUPTED",
    "STALE_HOURS",
    "FINAL_STATUSES",
    "KINDS",
    "STATUSES",
    "RUN_WEIGHTS_PREFIX",
    "atomic_write",
    "atomic_write_json",
    "default_results_dir",
    "effective_status",
    "environment",
    "local_path",
    "machine_load",
    "new_run_id",
    "portable_path",
    "portable_paths",
    "portable_text",
    "run_seed",
    "seeded_name",
    "weights_run",
    "load_entry",
    "copy_entry",
    "KeptWeightsError",
    "keep",
    "kept_path",
    "sha256",
    "weights_file",
]


def load_entry(run_id: str, results_dir: Path | str | None = None) -> dict[str, Any] | None:
    """The record of entry ``run_id`` (its file; a completed entry folded into a pack, from the packs),
    or ``None``; :class:`LedgerError` naming its file when that is there but broken (unreadable, or
    breaking the schema): a lookup by run id never reads a broken entry as no entry."""
    entry = LedgerEntry.load(run_id, results_dir, strict=True)
    if entry is not None:
        return entry.record
    from vitexp.ledger.packs import packed_record

    return packed_record(Path(results_dir) if results_dir else default_results_dir(), run_id)


def copy_entry(record: dict[str, Any], results_dir: Path | str) -> Path:
    """Write ``record`` as an entry of the results root ``results_dir`` (atomically), so a command run
    there finds it (a rerun's pinned start); the entry's path."""
    from vitexp.ledger.paths import atomic_write_json

    path = Path(results_dir) / "runs" / f"{record['run_id']}.json"
    atomic_write_json(path, record)
    return path


def weights_run(
    spec: str, results_dir: Path | str | None = None, ledger: Ledger | None = None
) -> dict[str, Any]:
    """The ledger record behind ``run:<experiment>`` (its newest completed train run) or
    ``run:<run_id>`` (that entry alone, read without loading the ledger), checked to have its
    recorded ``weights`` file, or its kept copy (:mod:`vitexp.ledger.kept`), on this machine.
    ``FileNotFoundError`` says what to run;
    :class:`LedgerError`, which broken entry of that experiment stops it."""
    target = str(spec).removeprefix(RUN_WEIGHTS_PREFIX)
    where = Path(results_dir) if results_dir else default_results_dir()
    pinned = load_entry(target, where) if ledger is None else ledger.get(target)
    own = [b for b in (ledger.broken if ledger is not None else ()) if b.path == f"runs/{target}.json"]
    if pinned is None and own:  # the run id's own file, broken: named, not "no such run"
        raise LedgerError(own, f"{where / 'runs'} (backbone.pretrained={spec})")
    if pinned is not None:
        run = pinned if pinned.get("status") == "completed" and pinned.get("kind") == "train" else None
    else:  # the newest of an experiment: a broken entry of it could be the newest
        ledger = ledger or Ledger.load(where)
        ledger.check([target], f"{where / 'runs'} (backbone.pretrained={spec})")
        run = ledger.newest(target, "train")
    if run is None:
        raise FileNotFoundError(
            f"backbone.pretrained={spec}: no completed train run of {target!r} in {where / 'runs'}; "
            f"run `vitexp-train experiment={target}` first"
        )
    try:
        here = weights_file(run, where)
    except KeptWeightsError as err:
        raise KeptWeightsError(f"backbone.pretrained={spec}: {err}") from None
    if here is None:
        recorded = local_path((run.get("artifacts") or {}).get("weights"), where)
        raise FileNotFoundError(
            f"backbone.pretrained={spec}: run {run['run_id']} recorded weights at {recorded}, "
            f"which is not on this machine, and none are kept at {kept_path(run['run_id'], where)}; "
            f"rerun `vitexp-train experiment={target}`"
        )
    return run
