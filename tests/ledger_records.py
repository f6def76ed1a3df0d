"""The ledger's records as the tests read them (vitexp.ledger.Ledger, checked: a broken entry raises)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from vitexp.ledger import Ledger


def iter_runs(results_dir: Path | str | None = None) -> Iterator[dict[str, Any]]:
    """Every entry of the ledger, oldest first; a broken entry raises :class:`vitexp.ledger.LedgerError`."""
    ledger = Ledger.load(results_dir)
    ledger.check()
    yield from ledger.records


def completed_runs(
    experiment: str | None = None, kind: str | None = None, results_dir: Path | str | None = None
) -> list[dict[str, Any]]:
    """The completed entries (of ``experiment`` and ``kind`` when given), oldest first."""
    ledger = Ledger.load(results_dir)
    ledger.check(None if experiment is None else [experiment])
    return ledger.completed(experiment, kind)
