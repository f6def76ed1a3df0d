"""Writing one run's ledger entry: :class:`LedgerEntry`, and what it records of the code and the machine
(:func:`environment`).

Its reasoning: docs/ledger.md, "vitexp/ledger/entry.py".
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from vitexp.ledger import fingerprint as fp
from vitexp.ledger.paths import (
    PROJECT_ROOT,
    atomic_write,
    atomic_write_json,
    default_results_dir,
    json_default,
    portable_path,
    portable_paths,
)
from vitexp.ledger.schema import FINAL_STATUSES, BrokenEntry, LedgerError, bad_metrics, problems, validated
from vitexp.ledger.status import INTERRUPTED, now

#: What ``git_dirty`` and the stored diff cover: the code a run executes and the specs it is launched from.
CODE_PATHS = ("vitexp", "conf", "sweeps", "pyproject.toml")
PATCH_NAME = "code.patch"


def short_name(name: str, limit: int = 80, keep: str = "-_") -> str:
    """``name`` with every character but letters, digits and ``keep`` made ``-``, cut to ``limit``
    characters with a hash of the whole (a name with many overrides would pass a file name's limit)."""
    safe = "".join(c if c.isalnum() or c in keep else "-" for c in name)
    if len(safe) <= limit:
        return safe
    return f"{safe[: limit - 9]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def new_run_id(experiment: str, kind: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{kind}-{short_name(experiment)}-{uuid.uuid4().hex[:6]}"


def _git(*args: str, ok: tuple[int, ...] = (0,), root: Path = PROJECT_ROOT) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode in ok else None


#: Files that are code wherever they lie in :data:`CODE_PATHS`, even where an ignore rule hides them.
CODE_SUFFIXES = (".py", ".yaml", ".sh")


def code_state(root: Path = PROJECT_ROOT) -> tuple[str | None, bool | None, str]:
    """(commit, dirty, diff) of :data:`CODE_PATHS` in the checkout ``root`` (``None`` outside a git
    checkout): ``git diff HEAD`` of the tracked files, then every untracked, not ignored file as a
    new file (``git diff --no-index /dev/null FILE``, which ``git apply`` takes), in path order; an
    ignored file with a suffix of :data:`CODE_SUFFIXES` counts as untracked."""
    commit = (_git("rev-parse", "HEAD", root=root) or "").strip() or None
    if commit is None:
        return None, None, ""
    diff = _git("diff", "HEAD", "--binary", "--", *CODE_PATHS, root=root) or ""
    listed = _git("ls-files", "--others", "--exclude-standard", "-z", "--", *CODE_PATHS, root=root) or ""
    # code that an ignore rule hides (an unanchored outputs/ matches vitexp/outputs/x.py) is code still
    hidden = _git(
        "ls-files", "--others", "--ignored", "--exclude-standard", "-z", "--", *CODE_PATHS, root=root
    )
    listed += "\0" + "\0".join(p for p in (hidden or "").split("\0") if p.endswith(CODE_SUFFIXES))
    for path in sorted({p for p in listed.split("\0") if p}):
        diff += (
            _git("diff", "--no-index", "--binary", "--", "/dev/null", path, ok=(0, 1), root=root) or ""
        )  # 1: differ
    return commit, bool(diff.strip()), diff


def keep_patch(diff: str, run_dir: Path | None, results_dir: Path) -> dict[str, Any]:
    """Write a dirty tree's diff where the module docstring says; ``{"path", "sha256"}`` (the path
    of the copy beside the ledger, relative to the results root)."""
    digest = hashlib.sha256(diff.encode()).hexdigest()
    kept = results_dir / "patches" / f"{digest[:16]}.patch"
    for path in (kept, Path(run_dir) / PATCH_NAME if run_dir else None):
        if path is not None and not (
            path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == digest
        ):
            atomic_write(path, diff)
    return {"path": portable_path(kept.resolve(), results_dir), "sha256": digest}


def machine_load() -> dict[str, Any]:
    """The machine's 1/5/15-minute load average, its CPU count and this process's compute threads."""
    import torch

    try:
        loadavg = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on this platform
        loadavg = None
    return {"loadavg": loadavg, "cpus": os.cpu_count(), "threads": torch.get_num_threads()}


#: Where a SLURM task runs, as SLURM tells it (the environment's name: the entry's key).
SLURM_PLACE = {
    "SLURM_JOB_ID": "job_id",
    "SLURM_ARRAY_JOB_ID": "array_job_id",
    "SLURM_ARRAY_TASK_ID": "array_task_id",
    "SLURM_JOB_NODELIST": "nodes",
    "SLURMD_NODENAME": "node",
    "SLURM_PROCID": "procid",
    "SLURM_RESTART_COUNT": "restart_count",
}


def slurm_place() -> dict[str, str]:
    """The SLURM job and nodes of this process (empty outside SLURM): recorded with each attempt, so an
    entry says where every attempt of a requeued run ran."""
    return {key: os.environ[var] for var, key in SLURM_PLACE.items() if os.environ.get(var)}


def environment(run_dir: Path | None = None, results_dir: Path | None = None) -> dict[str, Any]:
    """Package versions, device, the code (commit, dirty, the kept diff) and the machine's load."""
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in ("torch", "torchvision", "lightning", "timm", "hydra-core", "torchmetrics", "fvcore", "wandb"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    commit, dirty, diff = code_state()
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or platform.machine()})"
    )
    env = {
        "packages": versions,
        "python": platform.python_version(),
        "device": device,
        "cpu_threads": torch.get_num_threads(),
        "hostname": platform.node(),
        "pid": os.getpid(),
        "git_commit": commit,
        "git_dirty": dirty,
        "load": machine_load(),
        "cpu": {"model": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability()},
    }
    slurm = slurm_place()
    if slurm:
        env["slurm"] = slurm
    if dirty:
        env["code_patch"] = keep_patch(
            diff, run_dir, Path(results_dir) if results_dir else default_results_dir()
        )
    return env


def _seconds(started: Any, finished: Any) -> float:
    """Seconds from ``started`` to ``finished`` (ISO times as :func:`~vitexp.ledger.status.now` writes
    them); 0 when either is missing."""
    if not started or not finished:
        return 0.0
    return max(
        0.0,
        (
            _dt.datetime.fromisoformat(str(finished)) - _dt.datetime.fromisoformat(str(started))
        ).total_seconds(),
    )


class LedgerEntry:
    """One run's ledger file. ``start`` writes it as running; ``finish`` / ``fail`` / ``interrupt`` close
    it."""

    def __init__(
        self,
        experiment: str,
        kind: str,
        config: dict[str, Any] | None = None,
        results_dir: Path | str | None = None,
        run_id: str | None = None,
        run_dir: Path | str | None = None,
    ):
        self.dir = Path(results_dir) if results_dir else default_results_dir()
        self.run_id = run_id or new_run_id(experiment, kind)
        self.path = self.dir / "runs" / f"{self.run_id}.json"
        self.run_dir = Path(run_dir) if run_dir else None
        self.fit_times: dict[str, float] = {}
        self.clock = time.perf_counter()  # this attempt's start (attempt_wall_time_s)
        self.record: dict[str, Any] = {
            "run_id": self.run_id,
            "experiment": experiment,
            "status": "running",
            "kind": kind,
            "config": config or {},
            "metrics": {},
            "protocol": {},
            "env": environment(self.run_dir, self.dir),
            "wandb_url": None,
            "started": now(),
            "finished": None,
            "error": None,
        }
        self._fingerprint(config)

    @classmethod
    def load(
        cls, run_id: str, results_dir: Path | str | None = None, strict: bool = False
    ) -> "LedgerEntry | None":
        """The existing entry ``run_id`` (to reopen it), or None when there is no readable file;
        ``strict``: a file that is there but unreadable raises :class:`LedgerError` naming it."""
        entry = cls.__new__(cls)
        entry.dir = Path(results_dir) if results_dir else default_results_dir()
        entry.run_id, entry.run_dir, entry.fit_times, entry.clock = run_id, None, {}, time.perf_counter()
        entry.path = entry.dir / "runs" / f"{run_id}.json"
        try:
            entry.record = json.loads(entry.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            if strict:
                raise LedgerError(
                    [BrokenEntry(f"runs/{entry.path.name}", f"unreadable ({type(err).__name__}: {err})")],
                    str(entry.dir / "runs"),
                ) from None
            return None
        if strict:
            wrong = problems(entry.record, run_id)
            if wrong:
                raise LedgerError(
                    [BrokenEntry(f"runs/{entry.path.name}", "; ".join(wrong))], str(entry.dir / "runs")
                )
        return entry if isinstance(entry.record, dict) else None

    def experiment_of(self, run_id: str) -> str:
        """The experiment of entry ``run_id`` in this ledger (``run_id`` itself when there is none)."""
        if not run_id or "/" in run_id:
            return run_id
        other = LedgerEntry.load(run_id, self.dir)
        if other is None:  # a completed entry folded into a pack
            from vitexp.ledger.packs import packed_record

            return str((packed_record(self.dir, run_id) or {}).get("experiment", run_id))
        return str(other.record.get("experiment", run_id))

    def reopen(self, config: dict[str, Any], run_dir: Path | str | None = None) -> "LedgerEntry":
        """Continue this unfinished entry in a new attempt (module docstring)."""
        if self.record["status"] == "completed":
            raise RuntimeError(
                f"ledger entry {self.path} is completed; finished results are never overwritten"
            )
        self.run_dir = Path(run_dir) if run_dir else self.run_dir
        previous = {k: self.record.get(k) for k in ("started", "finished", "status", "error", "signal")}
        if self.record.get(
            "requeued"
        ):  # how the attempt was requeued (vitexp.runs.slurm): the attempt's, not the run's
            previous["requeued"] = self.record.pop("requeued")
        previous["resumed_from"] = self.record.pop("resumed_from", None)
        previous["env"] = {k: (self.record.get("env") or {}).get(k) for k in ("hostname", "pid")}
        if (self.record.get("env") or {}).get("slurm"):
            previous["env"]["slurm"] = self.record["env"]["slurm"]
        previous["fit_time_s"] = dict(self.record.get("attempt_fit_time_s") or {})
        if previous["status"] == "running":  # its process died without closing it
            previous.update(
                status=INTERRUPTED,
                finished=self.record.get("heartbeat") or self.record.get("started"),
                error="the process ended without closing its entry (killed)",
            )
        wall = self.record.get("attempt_wall_time_s")
        previous["wall_time_s"] = (
            float(wall) if wall is not None else _seconds(previous["started"], previous["finished"])
        )
        self.record["attempts"] = [*self.record.get("attempts", []), previous]
        self._fingerprint(config)
        self.clock = time.perf_counter()
        self.record.update(
            status="running",
            config=config,
            env=environment(self.run_dir, self.dir),
            finished=None,
            error=None,
            signal=None,
            attempt_fit_time_s={},
            attempt_wall_time_s=0.0,
            resumed_from=None,
        )
        self._write()
        return self

    def _fingerprint(self, config: dict[str, Any] | None) -> None:
        """Record the config's fingerprint (none for a config that is not a composed run config)."""
        key = fp.of_config(config, self.experiment_of)
        if key:
            self.record["fingerprint"] = key
        else:
            self.record.pop("fingerprint", None)

    def previous_fit_time(self) -> dict[str, float]:
        """{stage: seconds fitted by the earlier attempts of this run}."""
        out: dict[str, float] = {}
        for attempt in self.record.get("attempts") or []:
            for stage, seconds in (attempt.get("fit_time_s") or {}).items():
                out[stage] = out.get(stage, 0.0) + float(seconds)
        return out

    def previous_wall_time(self) -> float:
        """Seconds of wall time of the earlier attempts of this run (module docstring)."""
        return sum(float(a.get("wall_time_s") or 0.0) for a in self.record.get("attempts") or [])

    def _clock(self) -> None:
        self.record["attempt_wall_time_s"] = round(time.perf_counter() - self.clock, 3)

    def fitting(self, stage: str, seconds: float) -> None:
        """This attempt has fitted ``stage`` for ``seconds`` so far (written with the next beat or close)."""
        self.fit_times[stage] = float(seconds)
        self.record["attempt_fit_time_s"] = dict(self.fit_times)

    def _write(self) -> None:
        """Write the record, its paths made portable (:func:`vitexp.ledger.paths.portable_paths`),
        checked against the schema and its times in UTC (:func:`vitexp.ledger.schema.validated`: a
        record that breaks it raises ``ValueError`` and nothing is written)."""
        record = json.loads(json.dumps(portable_paths(self.record, self.dir), default=json_default))
        self.record = validated(record)
        atomic_write_json(self.path, self.record)

    def resumed(self, stage: str, checkpoint: Path | str, epoch: int, global_step: int) -> None:
        """This attempt's fit of ``stage`` restored ``checkpoint`` with ``epoch`` epochs done, at
        ``global_step`` (module docstring); written at once, so an attempt stopped again keeps it."""
        self.record["resumed_from"] = {
            **(self.record.get("resumed_from") or {}),
            stage: {
                "checkpoint": portable_path(checkpoint, self.dir),
                "epoch": int(epoch),
                "global_step": int(global_step),
            },
        }
        self._write()

    def beat(self) -> None:
        """Record that the run is alive (``heartbeat``, UTC): how a running entry written on another
        host (a cluster node) is told apart from one whose job died
        (:func:`vitexp.ledger.status.effective_status`).
        """
        if self.record.get("status") == "running":
            self.record["heartbeat"] = now()
            self._clock()
            self._write()
            if getattr(self, "on_beat", None):  # the run folder's lock, kept fresh
                self.on_beat()

    def start(self) -> "LedgerEntry":
        if self.path.exists():
            raise FileExistsError(
                f"ledger entry {self.path} already exists; finished results are never overwritten"
            )
        self._write()
        return self

    def _close(self, status: str, **fields: Any) -> Path:
        if self.record["status"] in FINAL_STATUSES:
            raise RuntimeError(f"ledger entry {self.path} is already {self.record['status']}")
        before = dict(self.record)
        self.record.update(fields)
        self.record["status"] = status
        self.record["finished"] = now()
        self._clock()
        try:
            self._write()
        except BaseException:  # not written (a full disk, a record the schema refuses): still open
            self.record = before
            raise
        return self.path

    def finish(self, metrics: dict[str, Any], protocol: dict[str, Any] | None = None, **extra: Any) -> Path:
        """Close the entry completed with ``metrics``; refuses a metric that holds NaN or Infinity
        (``ValueError`` naming it: the run fails, its entry stays open for :meth:`fail`)."""
        bad = bad_metrics(json.loads(json.dumps(dict(metrics), default=json_default)))
        if bad:
            raise ValueError(f"run {self.run_id} is not completed: {'; '.join(bad)}")
        return self._close("completed", metrics=dict(metrics), protocol=dict(protocol or {}), **extra)

    def fail(self, error: BaseException, **extra: Any) -> Path:
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        return self._close("failed", error=detail, **extra)

    def interrupt(self, signal_name: str, **extra: Any) -> Path:
        """Close the entry ``interrupted`` by ``signal_name`` (``SIGINT``, ``SIGTERM``): not a failure
        of the run; ``resume=auto`` continues it."""
        return self._close(INTERRUPTED, signal=signal_name, error=f"interrupted by {signal_name}", **extra)


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``), recorded with loader rates and with every run's
    environment: one-thread training repeats bit for bit on one machine and not always across machines."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None
