"""Kept weights: a copy of a run's ``weights.pth`` stored with the results, so the runs that load it
(``backbone.pretrained=run:<name>``) can be trained on another machine, or after this machine's
``outputs/`` are gone, against the same start.

Decisions:
- What is kept: the weights of a table's shared start (a row with ``seeds: null`` whose seeded rows
  load it, :func:`vitexp.aggregate.shared_start`); ``vitexp-sweep TABLE --keep-starts`` keeps them,
  and a sweep keeps them after it ran. Other runs' weights stay in their run folders.
- Where: ``<results>/weights/<run_id>.pth`` beside ``<run_id>.json`` (the run, its experiment, the
  file's size and sha256). The size and hash are read on the machine that trained the run, from
  the file its entry records; a kept copy whose bytes differ (a truncated copy, a Git LFS pointer)
  is refused when read, naming both hashes.
- A run whose entry records ``artifacts.weights_sha256`` (every train run saves it) is kept only
  when its file still has that hash: the copy is the model the run evaluated.
- Reading: the file the entry records when it is on this machine, else the kept copy
  (:func:`weights_file`); nothing is fetched.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from vitexp.ledger.paths import atomic_write, atomic_write_json, local_path, portable_path
KEPT_SUBDIR = "weights"


class KeptWeightsError(FileNotFoundError):
    """A kept copy, or the file to keep, whose bytes are not the ones recorded: as unusable as a
    missing file, so every caller that reports a missing weights file reports this too."""


def sha256(path: Path | str) -> str:
    """The file's sha256, hex."""
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
    """The kept copy of ``run``'s weights, checked against the size and sha256 recorded when it was
    kept; ``None`` when none is kept. :class:`KeptWeightsError` when the copy's bytes differ."""
    path, record_path = kept_path(run["run_id"], results_dir), _record_path(run["run_id"], results_dir)
    if not path.is_file() or not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text())
        expected = record["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise KeptWeightsError(f"{record_path}: not a kept-weights record ({err})") from None
    found = sha256(path)
    if found != expected:
        raise KeptWeightsError(f"{path}: the kept weights of run {run['run_id']} have sha256 {found[:12]}, not the "
                          f"{expected[:12]} recorded when they were kept ({record.get('bytes')} bytes; this file "
                          f"has {path.stat().st_size}): copy them again from the machine that trained the run")
    return path


def weights_file(run: dict[str, Any], results_dir: Path | str) -> Path | None:
    """The weights of a completed run on this machine: the file its entry records
    (``artifacts.weights``) when it is here, else its kept copy; ``None`` when neither is."""
    recorded = local_path((run.get("artifacts") or {}).get("weights"), results_dir)
    if recorded is not None and recorded.is_file():
        return recorded
    return kept_copy(run, results_dir)


def keep(run: dict[str, Any], results_dir: Path | str) -> dict[str, Any]:
    """Copy ``run``'s recorded weights to :func:`kept_path` with their size and sha256 (atomic; a copy
    already kept with the same hash is left as it is). ``FileNotFoundError`` when the recorded file
    is not on this machine; :class:`KeptWeightsError` when it no longer has the sha256 its entry records."""
    artifacts = run.get("artifacts") or {}
    source = local_path(artifacts.get("weights"), results_dir)
    if source is None or not source.is_file():
        raise FileNotFoundError(f"run {run['run_id']} ({run.get('experiment')}): its weights {source} are not on "
                                f"this machine, so they cannot be kept")
    digest = sha256(source)
    if artifacts.get("weights_sha256") and artifacts["weights_sha256"] != digest:
        raise KeptWeightsError(f"{source}: sha256 {digest[:12]}, not the {artifacts['weights_sha256'][:12]} run "
                          f"{run['run_id']} recorded when it saved them; they were changed after the run")
    target, record_path = kept_path(run["run_id"], results_dir), _record_path(run["run_id"], results_dir)
    record = {"run_id": run["run_id"], "experiment": run.get("experiment"), "bytes": source.stat().st_size,
              "sha256": digest, "source": portable_path(source, results_dir)}
    if target.is_file() and record_path.is_file() and sha256(target) == digest:
        return {**record, "kept": portable_path(target, results_dir), "copied": False}
    atomic_write(target, lambda tmp: shutil.copyfile(source, tmp))
    atomic_write_json(record_path, record)
    return {**record, "kept": portable_path(target, results_dir), "copied": True}
