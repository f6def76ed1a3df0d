"""The results ledger: one JSON file per run in ``results/runs/<run_id>.json``.

Schema (design.md): ``run_id``, ``experiment``, ``status`` (running | completed | failed),
``kind`` (train | flops | bench | audit | ...), ``config`` (resolved), ``metrics``, ``protocol``,
``env``, ``wandb_url``, ``started``, ``finished``, ``error``.

Decisions:
- A run writes its entry twice: ``running`` when it starts (so a run killed by SIGKILL is
  visible), then ``completed`` or ``failed``. Every write goes to a temporary file in the same
  directory, is fsync'ed, then ``os.replace``d over the target, so a reader never sees half a
  file and concurrent runs never collide (run ids carry a random suffix).
- A finished entry (completed or failed) is never overwritten: ``finish`` refuses.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import tempfile
import traceback
import uuid
from pathlib import Path
from typing import Any, Iterator

from vitexp import PROJECT_ROOT

FINAL_STATUSES = ("completed", "failed")


def default_results_dir() -> Path:
    """``$VITEXP_RESULTS`` if set, else ``results/`` in the source checkout."""
    return Path(os.environ.get("VITEXP_RESULTS", PROJECT_ROOT / "results"))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id(experiment: str, kind: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in experiment)
    return f"{stamp}-{kind}-{safe}-{uuid.uuid4().hex[:6]}"


def atomic_write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON to ``path`` through a temporary file and a rename (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=2, sort_keys=False, default=_json_default)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def environment() -> dict[str, Any]:
    """Package versions, device and git commit of this run."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "torchvision", "lightning", "timm", "hydra-core", "torchmetrics", "fvcore", "wandb"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip() or None
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=5,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()})"
    return {
        "packages": versions,
        "python": platform.python_version(),
        "device": device,
        "cpu_threads": torch.get_num_threads(),
        "hostname": platform.node(),
        "git_commit": commit,
        "git_dirty": dirty,
    }


class LedgerEntry:
    """One run's ledger file. ``start`` writes it as running; ``finish`` / ``fail`` close it."""

    def __init__(self, experiment: str, kind: str, config: dict[str, Any] | None = None,
                 results_dir: Path | str | None = None, run_id: str | None = None):
        self.dir = Path(results_dir) if results_dir else default_results_dir()
        self.run_id = run_id or new_run_id(experiment, kind)
        self.path = self.dir / "runs" / f"{self.run_id}.json"
        self.record: dict[str, Any] = {
            "run_id": self.run_id,
            "experiment": experiment,
            "status": "running",
            "kind": kind,
            "config": config or {},
            "metrics": {},
            "protocol": {},
            "env": environment(),
            "wandb_url": None,
            "started": _now(),
            "finished": None,
            "error": None,
        }

    def start(self) -> "LedgerEntry":
        if self.path.exists():
            raise FileExistsError(f"ledger entry {self.path} already exists; finished results are never overwritten")
        atomic_write_json(self.path, self.record)
        return self

    def _close(self, status: str, **fields: Any) -> Path:
        if self.record["status"] in FINAL_STATUSES:
            raise RuntimeError(f"ledger entry {self.path} is already {self.record['status']}")
        self.record.update(fields)
        self.record["status"] = status
        self.record["finished"] = _now()
        atomic_write_json(self.path, self.record)
        return self.path

    def finish(self, metrics: dict[str, Any], protocol: dict[str, Any] | None = None, **extra: Any) -> Path:
        return self._close("completed", metrics=dict(metrics), protocol=dict(protocol or {}), **extra)

    def fail(self, error: BaseException, **extra: Any) -> Path:
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        path = self._close("failed", error=detail, **extra)
        try:  # lets a CLI name the ledger file in its closing JSON line
            error.ledger_path = str(path)  # type: ignore[attr-defined]
        except AttributeError:
            pass
        return path


def iter_runs(results_dir: Path | str | None = None) -> Iterator[dict[str, Any]]:
    """Every readable ledger entry, oldest first (by start time)."""
    runs_dir = (Path(results_dir) if results_dir else default_results_dir()) / "runs"
    records = []
    for file in runs_dir.glob("*.json"):
        try:
            records.append(json.loads(file.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    yield from sorted(records, key=lambda r: (r.get("started") or "", r.get("run_id", "")))


def completed_runs(experiment: str | None = None, kind: str | None = None,
                   results_dir: Path | str | None = None) -> list[dict[str, Any]]:
    return [
        r for r in iter_runs(results_dir)
        if r.get("status") == "completed"
        and (experiment is None or r.get("experiment") == experiment)
        and (kind is None or r.get("kind") == kind)
    ]


#: ``backbone.pretrained: run:<experiment>`` takes the weights of that experiment's latest completed run.
RUN_WEIGHTS_PREFIX = "run:"


def resolve_weights(spec: str | None, results_dir: Path | str | None = None) -> str | None:
    """A ``backbone.pretrained`` value as a file path: a path is returned as given;
    ``run:<experiment>`` becomes the ``weights`` file recorded by the newest completed train run of
    that experiment (``run:<run_id>`` also works). Raises ``FileNotFoundError`` naming what to run."""
    if not spec or not str(spec).startswith(RUN_WEIGHTS_PREFIX):
        return spec
    return str(weights_run(spec, results_dir)["artifacts"]["weights"])


def weights_run(spec: str, results_dir: Path | str | None = None) -> dict[str, Any]:
    """The ledger record behind ``run:<experiment>`` (its newest completed train run) or
    ``run:<run_id>``, checked to have its recorded ``weights`` file on this machine."""
    target = str(spec).removeprefix(RUN_WEIGHTS_PREFIX)
    runs = [r for r in completed_runs(kind="train", results_dir=results_dir)
            if target in (r.get("experiment"), r.get("run_id"))]
    where = (Path(results_dir) if results_dir else default_results_dir()) / "runs"
    if not runs:
        raise FileNotFoundError(f"backbone.pretrained={spec}: no completed train run of {target!r} in {where}; "
                                f"run `vitexp-train experiment={target}` first")
    run = runs[-1]
    weights = (run.get("artifacts") or {}).get("weights")
    if not weights or not Path(weights).is_file():
        raise FileNotFoundError(f"backbone.pretrained={spec}: run {run['run_id']} recorded weights at {weights}, "
                                f"which is not on this machine; rerun `vitexp-train experiment={target}`")
    return run
