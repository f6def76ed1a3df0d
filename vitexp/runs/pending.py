"""A run's close that found no space: where its metrics go instead, and how resume reads them back.

Its reasoning: docs/ledger.md, "Runs that fail loud".
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from vitexp.ledger import LedgerEntry, atomic_write_json, portable_path, portable_paths

#: What a run could not write to its ledger entry (a full disk): its metrics and closing fields, in its
#: folder, which resume reads back (:meth:`Run.start`).
PENDING_CLOSE = "closing.json"
#: An ``OSError`` for want of space (a full disk, a quota).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class ClosedFromPending(Exception):
    """Raised by :meth:`Run.start` of a resumed run whose previous attempt had its metrics but could not
    write them: the entry is now closed with them, and the command's body has nothing left to do."""


class EntryNotWritten(OSError):
    """A run's entry could not be closed for want of space: where its metrics are instead."""

    def __init__(self, err: OSError, entry: str, pending: str | None):
        self.pending = pending
        kept = (
            f"its metrics are kept in {pending} (and in this line); resume=auto in the same folder closes"
            " the entry with them"
            if pending
            else "its metrics are in this line only (the run folder had no space either)"
        )
        super().__init__(
            err.errno,
            f"no space to close the ledger entry {entry} ({err.strerror or err}): {kept}",
        )


def keep_pending(
    entry: LedgerEntry, output_dir: Path | None, results_dir: Path, c: dict[str, Any], err: OSError
) -> EntryNotWritten:
    """The closing fields ``c`` the entry could not take, kept in the run folder (:data:`PENDING_CLOSE`)
    when that has room: the error naming where they are."""
    pending = None
    if output_dir is not None:
        try:
            kept = {
                "run_id": entry.run_id,
                "metrics": c["metrics"],
                "protocol": c["protocol"],
                "record": portable_paths(c["record"], results_dir),
                "out": c["out"],
            }
            atomic_write_json(output_dir / PENDING_CLOSE, kept)
            pending = portable_path(output_dir / PENDING_CLOSE, results_dir)
        except OSError:
            pending = None
    return EntryNotWritten(err, portable_path(entry.path, results_dir), pending)
