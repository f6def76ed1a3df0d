"""Kept weights: a copy of a run's ``weights.pth`` stored with the results, so the runs that load it
(``backbone.pretrained=run:<name>``) can be trained on another machine, or after this machine's
``outputs/`` are gone, against the same start.

Its reasoning: docs/ledger.md, "vitexp/ledger/kept.py".
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from vitexp.ledger.paths import atomic_write, atomic_write_json, local_path, portable_path

KEPT_SUBDIR = "weights"


class KeptWeightsError(FileNotFoundError):
    """A kept copy, or the file to keep, whose bytes are not the ones recorded: as unusable as a
    missing file, so every caller that reports a missing weights file reports this too."""


def sha256(path: Path | str) -> str:
    """The file's sha256, hex; read once per (path, size, modification time): a start is looked up
    several times per run (validation, the build, the sweep's plan)."""
    stat = os.stat(path)
    return _sha256(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def kept_path(run_id: str, results_dir: Path | str) -> Path:
    """Where run ``run_id``'s weights are kept: ``<results>/weights/<run_id>.pth``."""
    return Path(results_dir) / KEPT_SUBDIR / f"{run_id}.pth"


def _record_path(run_id: str, results_dir: Path | str) -> Path:
    return kept_path(run_id, results_dir).with_suffix(".json")


def kept_copy(run: dict[str, Any], results_dir: Path | str) -> Path | None:
    """The kept copy of ``run``'s weights, checked against its record (the same run; the size and
    sha256 recorded when it was kept, which must be the run's own ``weights_sha256`` when the entry
    has one); ``None`` when none is kept. :class:`KeptWeightsError` when any of that differs."""
    path, record_path = kept_path(run["run_id"], results_dir), _record_path(run["run_id"], results_dir)
    if not path.is_file() or not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text())
        expected, owner = record["sha256"], record["run_id"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise KeptWeightsError(f"{record_path}: not a kept-weights record ({err})") from None
    own = (run.get("artifacts") or {}).get("weights_sha256")
    if owner != run["run_id"] or (own and own != expected):
        raise KeptWeightsError(
            f"{record_path}: records run {owner} with sha256 {str(expected)[:12]}, not run "
            f"{run['run_id']}'s weights{f' ({own[:12]})' if own else ''}: keep them again"
        )
    found = sha256(path)
    if found != expected:
        raise KeptWeightsError(
            f"{path}: the kept weights of run {run['run_id']} have sha256 {found[:12]}, not the "
            f"{expected[:12]} recorded when they were kept ({record.get('bytes')} bytes; this file "
            f"has {path.stat().st_size}): copy them again from the machine that trained the run"
        )
    return path


def _recorded_file(run: dict[str, Any], results_dir: Path | str) -> Path | None:
    """The file the entry records, when it is on this machine and has the sha256 the run recorded."""
    artifacts = run.get("artifacts") or {}
    recorded = local_path(artifacts.get("weights"), results_dir)
    if recorded is None or not recorded.is_file():
        return None
    if artifacts.get("weights_sha256") and sha256(recorded) != artifacts["weights_sha256"]:
        return None
    return recorded


def weights_file(run: dict[str, Any], results_dir: Path | str) -> Path | None:
    """The weights of a completed run on this machine: the file its entry records when it is here
    with the run's recorded sha256, else its kept copy; ``None`` when neither is.
    :class:`KeptWeightsError` when the recorded file was changed after the run and no kept copy
    stands in for it, or when the kept copy is not the one recorded."""
    recorded = _recorded_file(run, results_dir)
    if recorded is not None:
        return recorded
    kept = kept_copy(run, results_dir)
    artifacts = run.get("artifacts") or {}
    path = local_path(artifacts.get("weights"), results_dir)
    if kept is None and path is not None and path.is_file():
        raise KeptWeightsError(
            f"{path}: sha256 {sha256(path)[:12]}, not the {artifacts['weights_sha256'][:12]} run "
            f"{run['run_id']} recorded when it saved them; they were changed after the run"
        )
    return kept


def keep(run: dict[str, Any], results_dir: Path | str) -> dict[str, Any]:
    """Copy ``run``'s recorded weights to :func:`kept_path` with their size and sha256 (atomic). A copy
    already kept for this run with the same hash, or, when the run folder is gone, a valid kept copy,
    is left as it is (``copied: False``). ``FileNotFoundError`` when neither the recorded file nor a
    kept copy is on this machine; :class:`KeptWeightsError` when the recorded file no longer has the
    sha256 its entry records."""
    artifacts = run.get("artifacts") or {}
    target, record_path = kept_path(run["run_id"], results_dir), _record_path(run["run_id"], results_dir)
    source = local_path(artifacts.get("weights"), results_dir)
    if source is None or not source.is_file():
        if kept_copy(run, results_dir) is None:
            raise FileNotFoundError(
                f"run {run['run_id']} ({run.get('experiment')}): its weights {source} are not on "
                "this machine and none are kept, so they cannot be kept"
            )
        record = json.loads(record_path.read_text())
        return {**record, "kept": portable_path(target, results_dir), "copied": False}
    digest = sha256(source)
    if artifacts.get("weights_sha256") and artifacts["weights_sha256"] != digest:
        raise KeptWeightsError(
            f"{source}: sha256 {digest[:12]}, not the {artifacts['weights_sha256'][:12]} run "
            f"{run['run_id']} recorded when it saved them; they were changed after the run"
        )
    record = {
        "run_id": run["run_id"],
        "experiment": run.get("experiment"),
        "bytes": source.stat().st_size,
        "sha256": digest,
        "source": portable_path(source, results_dir),
    }
    try:
        unchanged = json.loads(record_path.read_text()) == record and sha256(target) == digest
    except (OSError, ValueError):
        unchanged = False
    if unchanged:
        return {**record, "kept": portable_path(target, results_dir), "copied": False}
    atomic_write(target, lambda tmp: shutil.copyfile(source, tmp))
    atomic_write_json(record_path, record)
    return {**record, "kept": portable_path(target, results_dir), "copied": True}
