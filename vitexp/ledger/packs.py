"""Packs: a results root's completed entries, folded into one compressed file per pack.

``<root>/runs/`` holds one JSON file per run: the entry a running process rewrites (heartbeats,
stages, attempts), resumes and closes. A project accumulates hundreds of them (each a file in every
clone and in ``git status``); once completed an entry never changes again. ``vitexp-tables --pack``
moves every completed entry of ``runs/`` into ``<root>/ledger/<time>.jsonl.gz`` (a snapshot:
:func:`vitexp.ledger.sources.write_snapshot`, one JSON object a line, sorted, gzip'ed: about a thirtieth
of the files' bytes) and removes their files; :meth:`vitexp.ledger.Ledger.load` reads the packs and
the folder as one ledger, so tables, sweeps and ``run:<experiment>`` weights see the same runs before
and after a pack (a test regenerates tables from both).

Decisions:
- Only ``completed`` entries are packed: a failed or interrupted entry may still be reopened by
  ``resume=auto`` (:meth:`vitexp.ledger.LedgerEntry.load` reads ``runs/<run_id>.json``).
- Written, read back and compared before any file is removed; a pack never rewrites an older pack,
  so the history of ``main`` grows by the compressed new entries only. The pack's file is created
  exclusively (a second ``--pack`` in the same second removes nothing), and an entry written in the
  last :data:`SETTLED_S` seconds waits for the next pack.
- An entry found both in a pack and in ``runs/`` (a copy put back by hand) is read from ``runs/``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from vitexp.ledger.schema import BrokenEntry
from vitexp.ledger.sources import read_folder, read_snapshot, write_snapshot

PACKS = "ledger"
#: An entry written in the last SETTLED_S seconds is left in ``runs/`` (its process may still be closing it).
SETTLED_S = 300


def pack_files(root: Path) -> list[Path]:
    """The packs of a results root, oldest first."""
    folder = Path(root) / PACKS
    return sorted(folder.glob("*.jsonl.gz")) if folder.is_dir() else []


def read_root(root: Path, runs: Path) -> tuple[list[dict[str, Any]], list[BrokenEntry]]:
    """The entries of the packs of ``root`` and of the folder ``runs``, one per run id (module docstring)."""
    records, broken = read_folder(runs)
    seen = {r["run_id"] for r in records}
    for pack in pack_files(root):
        packed, bad = read_snapshot(pack)
        records += [r for r in packed if r["run_id"] not in seen]
        seen |= {r["run_id"] for r in packed}
        broken += bad
    return records, broken


def packed_record(root: Path, run_id: str) -> dict[str, Any] | None:
    """The record of ``run_id`` in a pack of ``root`` (a completed run whose file was folded), or ``None``."""
    return next((r for p in pack_files(root) for r in read_snapshot(p)[0] if r["run_id"] == run_id), None)


def packed(root: Path, run_id: str) -> bool:
    """Whether ``run_id`` is in a pack of ``root``."""
    return packed_record(root, run_id) is not None


def pack(root: Path) -> dict[str, Any]:
    """Fold the completed entries of ``<root>/runs/`` into a new pack (module docstring):
    ``{"pack": path or None, "packed": n, "left": n}``."""
    root = Path(root)
    runs = root / "runs"
    records, broken = read_folder(runs)
    if broken:
        raise ValueError(f"{len(broken)} broken entries in {runs} (first: {broken[0]}): fix them before packing")
    settled = time.time() - SETTLED_S
    done = [r for r in records if r.get("status") == "completed"
            and (runs / f"{r['run_id']}.json").stat().st_mtime < settled]
    if not done:
        return {"pack": None, "packed": 0, "left": len(records)}
    path = root / PACKS / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # reserved: a second pack started in the same second stops here, before it removes anything
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        raise FileExistsError(f"{path} exists: pack again in a second") from None
    write_snapshot(done, path)
    back, bad = read_snapshot(path)
    if bad or sorted(back, key=lambda r: r["run_id"]) != sorted(done, key=lambda r: r["run_id"]):
        path.unlink()
        raise RuntimeError(f"{path} did not read back as written; nothing removed")
    for r in done:
        (runs / f"{r['run_id']}.json").unlink()
    return {"pack": str(path), "packed": len(done), "left": len(records) - len(done)}
