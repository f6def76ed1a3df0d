"""Packs: a results root's completed entries, folded into one compressed file per pack.

Its reasoning: docs/ledger.md, "vitexp/ledger/packs.py".
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from vitexp.ledger.schema import BrokenEntry, LedgerError
from vitexp.ledger.sources import read_folder, read_snapshot, write_snapshot

PACKS = "ledger"
LOCK = ".lock"
#: An entry written in the last SETTLED_S seconds is left in ``runs/`` (its process may still be closing it).
SETTLED_S = 300


def pack_files(root: Path) -> list[Path]:
    """The packs of a results root, oldest first."""
    folder = Path(root) / PACKS
    return sorted(folder.glob("*.jsonl.gz")) if folder.is_dir() else []


def stray_files(root: Path) -> list[BrokenEntry]:
    """Every file of the ledger folder that is not a pack or the lock, named as a broken entry: a pack
    decompressed in place (``.jsonl``), any other name, a temporary file a killed pack write left
    (removed by the next pack). Nothing in the folder goes unread without a word."""
    folder = Path(root) / PACKS
    out = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        if path.name == LOCK or path.name.endswith(".jsonl.gz") and not path.name.startswith("."):
            continue
        why = (
            "a temporary file of a pack write that was killed (the next vitexp-tables --pack removes it)"
            if path.name.startswith(".")
            else "not a pack (a pack is <time>.jsonl.gz; a decompressed one: gzip it again)"
        )
        out.append(BrokenEntry(f"{PACKS}/{path.name}", why))
    return out


@dataclass
class PackIndex:
    """The packs of one results root as read now: their records oldest pack first (a run id in two
    packs: the older's), by run id, and the packs that could not be read."""

    records: list[dict[str, Any]] = field(default_factory=list)
    by_id: dict[str, dict[str, Any]] = field(default_factory=dict)
    broken: list[BrokenEntry] = field(default_factory=list)


#: {pack path: ((size, mtime_ns), its records, its broken entries)}: each pack parsed once per process.
_PARSED: dict[str, tuple[tuple[int, int], list[dict[str, Any]], list[BrokenEntry]]] = {}


def _read_pack(path: Path) -> tuple[list[dict[str, Any]], list[BrokenEntry]]:
    """A pack's records and broken entries; an empty pack (0 bytes, or no entry) is one broken entry."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return [], []
    key, signature = str(path.resolve()), (st.st_size, st.st_mtime_ns)
    cached = _PARSED.get(key)
    if cached is None or cached[0] != signature:
        where = f"{PACKS}/{path.name}"
        if st.st_size == 0:
            records, broken = [], [BrokenEntry(where, "an empty pack (0 bytes: a pack write that failed)")]
        else:
            records, broken = read_snapshot(path, where)
            if not records and not broken:
                broken = [BrokenEntry(where, "a pack that holds no entry")]
        _PARSED[key] = cached = (signature, records, broken)
    return cached[1], cached[2]


def pack_index(root: Path) -> PackIndex:
    """The packs of ``root`` (module docstring: parsed once per process)."""
    index = PackIndex()
    for path in pack_files(root):
        records, broken = _read_pack(path)
        for r in records:
            if r["run_id"] not in index.by_id:
                index.by_id[r["run_id"]] = r
                index.records.append(r)
        index.broken += broken
    index.broken += stray_files(root)
    return index


def read_root(root: Path, runs: Path) -> tuple[list[dict[str, Any]], list[BrokenEntry]]:
    """The entries of the packs of ``root`` and of the folder ``runs``, one per run id (module docstring)."""
    records, broken = read_folder(runs)
    seen = {r["run_id"] for r in records}
    index = pack_index(root)
    return records + [r for r in index.records if r["run_id"] not in seen], broken + index.broken


def packed_record(root: Path, run_id: str) -> dict[str, Any] | None:
    """The record of ``run_id`` in a pack of ``root`` (a completed run whose file was folded), or
    ``None``; :class:`LedgerError` naming the unreadable packs when it is in none of the others."""
    index = pack_index(root)
    if run_id in index.by_id:
        return index.by_id[run_id]
    if index.broken:
        raise LedgerError(index.broken, f"{Path(root) / PACKS} (looking for run {run_id})")
    return None


def packed(root: Path, run_id: str) -> bool:
    """Whether ``run_id`` is in a pack of ``root``."""
    return packed_record(root, run_id) is not None


def check_packs(root: Path) -> None:
    """:class:`LedgerError` naming every pack of ``root`` that cannot be read (what a run that may
    resume from, or load weights by, the ledger checks before it starts)."""
    broken = pack_index(root).broken
    if broken:
        raise LedgerError(broken, f"{Path(root) / PACKS}")


@contextmanager
def ledger_lock(root: Path) -> Iterator[None]:
    """The ledger's lock: an exclusive ``flock`` on ``<root>/ledger/.lock`` while the block runs
    (a second holder waits; the kernel releases it with a killed process)."""
    folder = Path(root) / PACKS
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def pack(root: Path) -> dict[str, Any]:
    """Fold the completed entries of ``<root>/runs/`` into a new pack under the ledger's lock (module
    docstring): ``{"pack": path or None, "packed": n, "left": n, "removed": n}`` (``removed``: files
    of entries another pack already held)."""
    root = Path(root)
    runs = root / "runs"
    with ledger_lock(root):
        for orphan in (root / PACKS).glob(".*"):  # a killed pack write's temporary file
            if orphan.name != LOCK and orphan.is_file():
                orphan.unlink(missing_ok=True)
        records, broken = read_folder(runs)
        if broken:
            raise ValueError(
                f"{len(broken)} broken entries in {runs} (first: {broken[0]}): fix them before packing"
            )
        index = pack_index(root)
        if index.broken:
            raise LedgerError(index.broken, f"{root / PACKS} (nothing packed)")
        settled = time.time() - SETTLED_S
        done, again = [], []
        for r in records:
            if r.get("status") != "completed":
                continue
            try:
                mtime = (runs / f"{r['run_id']}.json").stat().st_mtime
            except FileNotFoundError:
                continue
            if r["run_id"] in index.by_id:
                again += [r] if _same(index.by_id[r["run_id"]], r) else []
            elif mtime < settled:
                done.append(r)
        for r in again:  # packed by an earlier pack that stopped before removing it
            (runs / f"{r['run_id']}.json").unlink(missing_ok=True)
        left = len(records) - len(done) - len(again)
        if not done:
            return {"pack": None, "packed": 0, "left": left, "removed": len(again)}
        path = root / PACKS / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.jsonl.gz"
        try:  # reserved: a second pack started in the same second stops here, before it removes anything
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            raise FileExistsError(f"{path} exists: pack again in a second") from None
        try:
            write_snapshot(done, path)
            back, bad = read_snapshot(path)
        except BaseException:  # a full disk, a kill: the reserved file goes, every loose entry stays
            path.unlink(missing_ok=True)
            raise
        if bad or sorted(back, key=lambda r: r["run_id"]) != sorted(done, key=lambda r: r["run_id"]):
            path.unlink()
            raise RuntimeError(f"{path} did not read back as written; nothing removed")
        for r in done:
            (runs / f"{r['run_id']}.json").unlink(missing_ok=True)
        return {"pack": str(path), "packed": len(done), "left": left, "removed": len(again)}
