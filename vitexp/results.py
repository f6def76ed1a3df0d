"""Older imports of the ledger: everything here is :mod:`vitexp.ledger`'s, which reads and writes
results (kept so that scripts written against ``vitexp.results`` keep working; new code imports
:mod:`vitexp.ledger`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from vitexp.ledger import (INTERRUPTED, RUN_WEIGHTS_PREFIX, STALE_HOURS, Ledger, LedgerEntry,  # noqa: F401
                           atomic_write, atomic_write_json, default_results_dir, effective_status, environment,
                           local_path, new_run_id, portable_path, portable_paths, resolve_weights, weights_run)
from vitexp.ledger.schema import FINAL_STATUSES  # noqa: F401


def iter_runs(results_dir: Path | str | None = None) -> Iterator[dict[str, Any]]:
    """Every entry of the ledger, oldest first; a broken entry raises :class:`vitexp.ledger.LedgerError`."""
    ledger = Ledger.load(results_dir)
    ledger.check()
    yield from ledger.records


def completed_runs(experiment: str | None = None, kind: str | None = None,
                   results_dir: Path | str | None = None) -> list[dict[str, Any]]:
    """The completed entries (of ``experiment`` and ``kind`` when given), oldest first."""
    ledger = Ledger.load(results_dir)
    ledger.check(None if experiment is None else [experiment])
    return ledger.completed(experiment, kind)
