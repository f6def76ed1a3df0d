"""The results ledger: one JSON file per run in ``results/runs/<run_id>.json``.

Schema: ``run_id``, ``experiment``, ``status`` (running | completed | failed; shown
``interrupted`` when a running entry's process is gone, :func:`effective_status`), ``kind`` (train |
flops | bench | eval | audit | analyze), ``config`` (resolved), ``metrics``, ``protocol``, ``env``,
``wandb_id``, ``wandb_url``, ``started``, ``finished``, ``heartbeat``, ``error``, ``attempts`` (earlier attempts
of a resumed run), ``artifacts`` (e.g. ``weights``), and a method's record (``kept_heads``, ...).

Decisions:
- A run writes its entry twice: ``running`` when it starts (so a run killed by SIGKILL is
  visible), then ``completed`` or ``failed``. Every write goes to a temporary file in the same
  directory, is fsync'ed, then ``os.replace``d over the target, so a reader never sees half a
  file and concurrent runs never collide (run ids carry a random suffix).
- A finished entry (completed or failed) is never overwritten: ``finish`` refuses. The one
  exception is a resumed run (``resume=auto|true``), which reopens its own ``running`` or
  ``failed`` entry (:meth:`LedgerEntry.reopen`), keeping each earlier attempt in ``attempts``.
- A ``running`` entry records its ``host`` and ``pid``; when that process is gone the entry is
  :data:`INTERRUPTED` (:func:`effective_status`), which ``vitexp-tables`` shows and ``vitexp-sweep``
  reruns. An entry from another host is checked by its ``heartbeat`` (written after every training
  epoch and validation; before the first, its start): older than ``$VITEXP_STALE_HOURS`` (default 6)
  reads as interrupted. Work outside a fit (RAPTOR's phase pass, flops, bench) does not beat.
- Every path in an entry (the config's ``output_dir``, ``results_dir`` and ``data.root``,
  ``wandb_url``, artifacts) is stored relative to the project root, or to the results folder, when
  it lies inside one (:func:`portable_paths`), so results move between machines;
  :func:`local_path` turns them back into paths on this machine. A path outside both (a dataset
  under ``/datasets``) is kept as given: nothing else names it on another machine.
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
from typing import Any, Callable, Iterator

from vitexp import PROJECT_ROOT

FINAL_STATUSES = ("completed", "failed")
#: Shown for a ``running`` entry whose process (same host, recorded pid) no longer exists.
INTERRUPTED = "interrupted"


def default_results_dir() -> Path:
    """``$VITEXP_RESULTS`` if set, else ``results/`` in the source checkout."""
    return Path(os.environ.get("VITEXP_RESULTS", PROJECT_ROOT / "results"))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id(experiment: str, kind: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in experiment)
    return f"{stamp}-{kind}-{safe}-{uuid.uuid4().hex[:6]}"


def atomic_write(path: Path | str, content: str | bytes | Callable[[str], Any]) -> Path:
    """The one way vitexp writes a file: into a temporary file beside ``path``, fsync'ed, then
    ``os.replace``d over it (atomic on POSIX), so a killed process never leaves half a file.
    ``content`` is text, bytes, or a function that writes the temporary path it is given
    (``torch.save``, ``savefig``, a Lightning checkpoint)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if not callable(content):
                fh.write(content.encode() if isinstance(content, str) else content)
        if callable(content):
            content(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON through :func:`atomic_write`."""
    atomic_write(path, json.dumps(payload, indent=2, sort_keys=False, default=_json_default) + "\n")


def portable_path(path: Path | str | None, results_dir: Path | str | None = None) -> str | None:
    """``path`` relative to the project root, else to ``results_dir``, when it lies inside one;
    otherwise as given (nothing else names it on another machine). ``offline:<dir>`` keeps its prefix."""
    if path is None:
        return None
    text = str(path)
    prefix = ""
    if text.startswith("offline:"):
        prefix, text = "offline:", text[len("offline:"):]
    p = Path(text)
    if p.is_absolute():
        for root in (PROJECT_ROOT, Path(results_dir) if results_dir else default_results_dir()):
            try:
                return prefix + str(p.resolve().relative_to(Path(root).resolve()))
            except ValueError:
                continue
    return prefix + text


def portable_paths(value: Any, results_dir: Path | str | None = None) -> Any:
    """``value`` (a ledger record, or any part of one) with every string that is an absolute path
    made :func:`portable_path`, at any depth: the resolved config's ``output_dir``, ``results_dir``
    and ``data.root`` as much as the artifacts."""
    if isinstance(value, dict):
        return {k: portable_paths(v, results_dir) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable_paths(v, results_dir) for v in value]
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str) and value.removeprefix("offline:").startswith("/"):
        return portable_path(value, results_dir)
    return value


def local_path(path: str | None, results_dir: Path | str | None = None) -> Path | None:
    """A ledger path on this machine: absolute as given, else under the project root or the results folder."""
    if not path:
        return None
    p = Path(path)
    if p.is_absolute():
        return p
    candidates = [PROJECT_ROOT / p, (Path(results_dir) if results_dir else default_results_dir()) / p]
    return next((c for c in candidates if c.exists()), candidates[0])


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
        "pid": os.getpid(),
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

    @classmethod
    def load(cls, run_id: str, results_dir: Path | str | None = None) -> "LedgerEntry | None":
        """The existing entry ``run_id``, or None when there is no readable file."""
        entry = cls.__new__(cls)
        entry.dir = Path(results_dir) if results_dir else default_results_dir()
        entry.run_id = run_id
        entry.path = entry.dir / "runs" / f"{run_id}.json"
        try:
            entry.record = json.loads(entry.path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return entry

    def reopen(self, config: dict[str, Any]) -> "LedgerEntry":
        """Continue this (interrupted or failed) entry in a new attempt: status running again, this
        process's host and pid, the earlier attempt kept in ``attempts``."""
        if self.record["status"] == "completed":
            raise RuntimeError(f"ledger entry {self.path} is completed; finished results are never overwritten")
        previous = {k: self.record.get(k) for k in ("started", "finished", "status", "error")}
        previous["env"] = {k: (self.record.get("env") or {}).get(k) for k in ("hostname", "pid")}
        self.record["attempts"] = [*self.record.get("attempts", []), previous]
        self.record.update(status="running", config=config, env=environment(), finished=None, error=None)
        self._write()
        return self

    def _write(self) -> None:
        """Write the record, its paths made portable (:func:`portable_paths`)."""
        self.record = portable_paths(self.record, self.dir)
        atomic_write_json(self.path, self.record)

    def beat(self) -> None:
        """Record that the run is alive (``heartbeat``, UTC): how a running entry written on another
        host (a cluster node) is told apart from one whose job died (:func:`effective_status`)."""
        if self.record.get("status") == "running":
            self.record["heartbeat"] = _now()
            self._write()

    def start(self) -> "LedgerEntry":
        if self.path.exists():
            raise FileExistsError(f"ledger entry {self.path} already exists; finished results are never overwritten")
        self._write()
        return self

    def _close(self, status: str, **fields: Any) -> Path:
        if self.record["status"] in FINAL_STATUSES:
            raise RuntimeError(f"ledger entry {self.path} is already {self.record['status']}")
        self.record.update(fields)
        self.record["status"] = status
        self.record["finished"] = _now()
        self._write()
        return self.path

    def finish(self, metrics: dict[str, Any], protocol: dict[str, Any] | None = None, **extra: Any) -> Path:
        return self._close("completed", metrics=dict(metrics), protocol=dict(protocol or {}), **extra)

    def fail(self, error: BaseException, **extra: Any) -> Path:
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        return self._close("failed", error=detail, **extra)


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


#: A running entry from another host whose heartbeat (or start) is older than this many hours is
#: read as interrupted; ``$VITEXP_STALE_HOURS`` sets it (vitexp beats once per epoch and validation).
STALE_HOURS = 6.0


def effective_status(record: dict[str, Any], now: _dt.datetime | None = None) -> str:
    """The entry's status, with a ``running`` entry read as :data:`INTERRUPTED` when its process is
    gone: on this host, its pid no longer exists; on another host (a cluster node), its last
    ``heartbeat`` (else its start) is older than ``$VITEXP_STALE_HOURS`` (default :data:`STALE_HOURS`)."""
    status = record.get("status", "")
    if status != "running":
        return status
    env = record.get("env") or {}
    if env.get("hostname") == platform.node() and env.get("pid"):
        try:
            os.kill(int(env["pid"]), 0)
        except ProcessLookupError:
            return INTERRUPTED
        except (PermissionError, OSError):
            pass
        return status
    last = record.get("heartbeat") or record.get("started")
    if last:
        then = _dt.datetime.fromisoformat(str(last))
        if then.tzinfo is None:  # a timestamp without its zone (W&B's created_at) is UTC
            then = then.replace(tzinfo=_dt.timezone.utc)
        age = (now or _dt.datetime.now(_dt.timezone.utc)) - then
        if age.total_seconds() > 3600 * float(os.environ.get("VITEXP_STALE_HOURS", STALE_HOURS)):
            return INTERRUPTED
    return status


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
    return str(local_path(weights_run(spec, results_dir)["artifacts"]["weights"], results_dir))


def weights_run(spec: str, results_dir: Path | str | None = None) -> dict[str, Any]:
    """The ledger record behind ``run:<experiment>`` (its newest completed train run) or
    ``run:<run_id>``, checked to have its recorded ``weights`` file on this machine."""
    target = str(spec).removeprefix(RUN_WEIGHTS_PREFIX)
    where = (Path(results_dir) if results_dir else default_results_dir()) / "runs"
    pinned = LedgerEntry.load(target, results_dir)  # run:<run_id>: that one entry, no scan of the ledger
    if pinned is not None:
        record = pinned.record
        runs = [record] if record.get("status") == "completed" and record.get("kind") == "train" else []
    else:
        runs = [r for r in completed_runs(kind="train", results_dir=results_dir)
                if target in (r.get("experiment"), r.get("run_id"))]
    if not runs:
        raise FileNotFoundError(f"backbone.pretrained={spec}: no completed train run of {target!r} in {where}; "
                                f"run `vitexp-train experiment={target}` first")
    run = runs[-1]
    weights = local_path((run.get("artifacts") or {}).get("weights"), results_dir)
    if not weights or not weights.is_file():
        raise FileNotFoundError(f"backbone.pretrained={spec}: run {run['run_id']} recorded weights at {weights}, "
                                f"which is not on this machine; rerun `vitexp-train experiment={target}`")
    return run
