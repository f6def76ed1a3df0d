"""One owner per run: :func:`owned_run` holds a run's ledger entry, its logger and its closing JSON line
from start to last line, for every command (train, eval, flops, bench, audit, analyze).

Its reasoning: docs/cluster.md, "vitexp/runs/owner.py".
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from vitexp.errors import ConfigError, one_line
from vitexp.ledger import LedgerEntry, atomic_write_json, portable_path, portable_text
from vitexp.runs.pending import (
    NO_SPACE,
    PENDING_CLOSE,
    ClosedFromPending,
    EntryNotWritten,
    keep_pending,
)
from vitexp.runs.signals import catch_signals, pass_on

RUN_MARKER = "run.json"
RESUME_MODES = ("false", "true", "auto")


def is_rank_zero() -> bool:
    """Rank 0 of a (possibly distributed) job, by Lightning's rank utility (which reads
    ``RANK``/``LOCAL_RANK``/``SLURM_PROCID`` and is updated by the strategy)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def resume_mode(value: Any) -> str:
    """``resume`` as one of :data:`RESUME_MODES` (YAML booleans accepted)."""
    mode = str(value).lower()
    if mode not in RESUME_MODES:
        raise ConfigError(f"resume: {value!r} is not one of {RESUME_MODES}")
    return mode


def resume_checkpoint(resume: Any, checkpoint: Path, first: bool = True) -> str | None:
    """The checkpoint a stage continues from: ``checkpoint`` when resuming and it exists. Under
    ``resume=true`` the run's first stage must have one; a later stage without one starts fresh
    (the run was interrupted before it)."""
    mode = resume_mode(resume)
    if mode == "false":
        return None
    if checkpoint.is_file():
        return str(checkpoint)
    if mode == "true" and first:
        raise FileNotFoundError(
            f"resume=true but no checkpoint at {checkpoint}: pass the interrupted run's folder as"
            " hydra.run.dir (resume=auto starts fresh instead)"
        )
    return None


#: Config keys a requeued or resumed attempt may change without being another run.
ATTEMPT_KEYS = ("resume", "output_dir", "results_dir")


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """A short hash of a run's resolved config without :data:`ATTEMPT_KEYS`, with a pinned
    ``backbone.pretrained: run:<run_id>`` read as the experiment it names (each attempt pins the
    newest run anew; another experiment is another run): what makes a run folder's first attempt
    and a resumed one the same run (:func:`vitexp.ledger.fingerprint.digest`, the hash run folders
    have recorded since before fingerprints)."""
    from vitexp.ledger import load_entry, local_path
    from vitexp.ledger.fingerprint import digest

    results_dir = local_path(config.get("results_dir"), None) if config.get("results_dir") else None

    def experiment_of(run_id: str) -> str:
        return str((load_entry(run_id, results_dir) or {}).get("experiment", run_id))

    return digest(config, ATTEMPT_KEYS, experiment_of)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` whose usage errors (an unknown option, a missing argument) are one line on
    stderr, as every vitexp error, and end with the ``invalid`` closing line and exit 2."""

    def error(self, message: str):
        print(f"{self.prog}: invalid: {message} ({self.prog} --help lists the arguments)", file=sys.stderr)
        emit({"status": "invalid", "error": f"{self.prog}: {message}", "ledger": None})
        raise SystemExit(2)


def emit(payload: Mapping[str, Any]) -> None:
    """The closing line: one JSON object, flushed after anything on stderr."""
    sys.stderr.flush()
    print(json.dumps(dict(payload), default=str), flush=True)


def remove_if_empty(output_dir: Path | None) -> None:
    """Remove a run folder holding nothing but Hydra's own files (``.hydra/``, the job log), and
    the two folders above it if they are left empty (``outputs/<name>/``, ``outputs/``): what a run that
    failed validation leaves behind.
    """
    if output_dir is None or not (output_dir / ".hydra").is_dir():
        return
    if all(p.name == ".hydra" or p.suffix == ".log" for p in output_dir.iterdir()):
        shutil.rmtree(output_dir, ignore_errors=True)
        parents = list(output_dir.resolve().parents)[:2]  # outputs/<name>/, then outputs/, when left empty
        if len(parents) < 2 or parents[1].name not in ("outputs", "multirun"):
            return  # a folder the user chose (hydra.run.dir=/scratch/me/run1): nothing above it is vitexp's
        for parent in parents:
            try:
                parent.rmdir()
            except OSError:
                break


class Run:
    """The state :func:`owned_run` hands to a command's body."""

    def __init__(
        self,
        name: str,
        kind: str,
        results_dir: Path | str,
        output_dir: Path | str | None,
        logger_cfg: Mapping[str, Any] | None,
        resume: Any,
        job_type: str | None,
        resumable: bool,
    ):
        self.name, self.kind = name, kind
        self.results_dir = Path(results_dir)
        self.output_dir = Path(output_dir) if output_dir else None
        self.logger_cfg, self.resume, self.job_type = logger_cfg, resume_mode(resume), job_type or kind
        self.rank_zero, self.resumable = is_rank_zero(), resumable
        self.ledger: LedgerEntry | None = None
        self.wandb_id: str | None = None
        self.config: dict[str, Any] = {}
        self._logger: Any = None
        self._closing: dict[str, Any] | None = None
        self.lock = None
        self.signal: str | None = None
        self.requeued: str | None = None  # the requeue SIGUSR1 asks SLURM for (vitexp.runs.slurm)
        self.entry_closing = (
            False  # from the first line of _close or _fail: signals noted in deferred (vitexp.runs.signals)
        )
        self.deferred: list[str] = []

    # -- opening ----------------------------------------------------------------------------------
    def start(self, config: dict[str, Any]) -> "Run":
        """Open the ledger entry (rank zero): the interrupted attempt's own under resume, else a new one."""
        self.config = config
        if not self.rank_zero:
            return self
        if self.output_dir is not None:
            from vitexp.runs.lock import RunFolderLock

            self.lock = RunFolderLock(
                self.output_dir
            ).acquire()  # before run.json: never another process's run
        marker = self.output_dir / RUN_MARKER if self.output_dir and self.resumable else None
        previous = json.loads(marker.read_text()) if marker and marker.is_file() else {}
        if self.resume != "false" and previous.get("run_id"):
            self._check_same_run(previous, marker)
            entry = LedgerEntry.load(
                previous["run_id"], self.results_dir, strict=True
            )  # never a new entry in its place
            if entry is None:
                from vitexp.ledger.packs import packed

                done = packed(
                    Path(self.results_dir), previous["run_id"]
                )  # completed, its file folded into a pack
            else:
                done = entry.record.get("status") == "completed"
            if (
                done and self.resume == "auto"
            ):  # resume=true asks for exactly that: a new entry from the checkpoints
                raise ConfigError(
                    f"run folder {self.output_dir} holds the completed run {previous['run_id']}: resume=auto"
                    " would start another entry from its last checkpoint; give this run another"
                    " hydra.run.dir (its weights and checkpoints stay where its entry points), or"
                    " resume=true to re-test its checkpoints"
                )
            if entry is not None and not done:
                self.ledger, self.wandb_id = entry.reopen(config, self.output_dir), previous.get("wandb_id")
                self._close_from_pending(previous["run_id"])
        if self.ledger is None:
            self.ledger = LedgerEntry(
                self.name, self.kind, config, self.results_dir, run_dir=self.output_dir
            ).start()
            self.wandb_id = uuid.uuid4().hex[:8]  # W&B's id format: 8 characters [0-9a-z]
            if marker:
                atomic_write_json(
                    marker,
                    {
                        "run_id": self.ledger.run_id,
                        "wandb_id": self.wandb_id,
                        "name": self.name,
                        "config_sha": config_fingerprint(config),
                    },
                )
        self.ledger.record["wandb_id"] = self.wandb_id
        if (self.logger_cfg or {}).get("kind") == "wandb":  # the names W&B is given (vitexp.runs.loggers)
            from vitexp.runs.loggers import wandb_name

            self.ledger.record["wandb_name"] = wandb_name(self.ledger.run_id)
        if self.resumable:
            self.ledger.record.setdefault(
                "resumed_from", None
            )  # a fresh start (vitexp.runs.callbacks.ResumedFrom)
        self.ledger.on_beat = self.lock.touch if self.lock else None
        return self

    def _close_from_pending(self, run_id: str) -> None:
        """The previous attempt ended with its metrics but no space to write them
        (:data:`PENDING_CLOSE`): close the reopened entry ``completed`` with them, and end the command
        (:class:`ClosedFromPending`) instead of running it again."""
        pending_file = self.output_dir / PENDING_CLOSE if self.output_dir else None
        if pending_file is None or not pending_file.is_file():
            return
        pending = json.loads(pending_file.read_text())
        if pending.get("run_id") != run_id:
            return
        where = portable_path(pending_file, self.results_dir)
        path = self.ledger.finish(
            pending["metrics"], pending.get("protocol"), recovered_from=where, **pending.get("record", {})
        )
        pending_file.unlink()
        self.result = {
            "metrics": pending["metrics"],
            **pending.get("out", {}),
            "ledger": portable_path(path, self.results_dir),
            "run_id": run_id,
            "recovered_from": where,
        }
        raise ClosedFromPending(run_id)

    def _check_same_run(self, previous: Mapping[str, Any], marker: Path) -> None:
        """Resuming continues the run the folder holds, never another: the name and the config
        (:func:`config_fingerprint`) must be those of the first attempt (markers that predate these
        keys are not checked)."""
        theirs = {k: previous[k] for k in ("name", "config_sha") if k in previous}
        ours = {"name": self.name, "config_sha": config_fingerprint(self.config)}
        changed = [k for k in theirs if theirs[k] != ours[k]]
        if changed:
            raise ConfigError(
                f"resume={self.resume}: {marker.parent} holds run"
                f" {previous.get('name', previous['run_id'])!r} ({previous['run_id']}), whose"
                f" {' and '.join(changed)} differ from this command's; resuming would continue that run with"
                " this config. Use another hydra.run.dir, or resume=false to start fresh there"
            )

    @property
    def logger(self):
        """The Lightning logger of this run (``False`` on other ranks or with ``logger=none``)."""
        if self._logger is None:
            from vitexp.runs.loggers import build_logger

            if not self.rank_zero or not self.logger_cfg:
                self._logger = False
            else:
                save_dir = self.output_dir or self.results_dir / self.kind
                self._logger = build_logger(
                    self.logger_cfg,
                    self.name,
                    save_dir,
                    self.config,
                    job_type=self.job_type,
                    run_id=self.wandb_id,
                )
        return self._logger

    def _log_code(self) -> None:
        """A run from a dirty tree logs its kept diff as the W&B run's code."""
        from vitexp.ledger import local_path
        from vitexp.runs.loggers import log_code_patch

        patch = (
            ((self.ledger.record.get("env") or {}).get("code_patch") or {}).get("path")
            if self.ledger
            else None
        )
        if patch:
            log_code_patch(self._logger, local_path(patch, self.results_dir))

    # -- closing ----------------------------------------------------------------------------------
    def complete(
        self,
        metrics: Mapping[str, Any],
        protocol: Mapping[str, Any] | None = None,
        out: Mapping[str, Any] | None = None,
        step: int | None = None,
        **record: Any,
    ) -> None:
        """What the entry closes with: ``metrics``, ``protocol``, ledger fields ``record`` (the
        ledger stores their paths portable), ``out`` (extra keys of the closing JSON line)."""
        self._closing = {
            "metrics": dict(metrics),
            "protocol": dict(protocol or {}),
            "out": dict(out or {}),
            "step": step,
            "record": record,
        }

    def _close(self) -> dict[str, Any]:
        from vitexp.runs.loggers import finish, log_final, wandb_url

        self.entry_closing = True
        if self._closing is None:
            raise RuntimeError(f"{self.kind} run {self.name} ended without run.complete(...)")
        c = self._closing
        result = {"metrics": c["metrics"], "ledger": None, "run_id": None, **c["out"]}
        if not self.rank_zero:
            return result
        try:
            log_final(self.logger, c["metrics"], step=c["step"])
            if self.output_dir is not None:
                c["record"].setdefault("output_dir", self.output_dir)
            self._log_code()
            self._log_weights(c)
            c["record"]["wandb_url"] = wandb_url(self.logger)
            try:
                path = self.ledger.finish(c["metrics"], c["protocol"], **c["record"])
            except OSError as err:
                if err.errno not in NO_SPACE:
                    raise
                self.pending_metrics = c["metrics"]
                raise keep_pending(self.ledger, self.output_dir, self.results_dir, c, err) from err
        except BaseException:
            finish(self._logger, failed=True)
            raise
        finish(self._logger)
        if c["record"].get("wandb_error"):
            result["wandb_error"] = c["record"]["wandb_error"]
        return {**result, "ledger": portable_path(path, self.results_dir), "run_id": self.ledger.run_id}

    def _log_weights(self, c: dict[str, Any]) -> None:
        """A run that saved weights (``artifacts.weights``) logs them as a W&B model artifact, its
        metadata the ledger record as it closes (what ``vitexp-eval`` needs on another machine); the
        ledger records its reference as ``artifacts.wandb_model``."""
        from vitexp.ledger import local_path, portable_paths
        from vitexp.runs.loggers import WandbRefused, log_model

        artifacts = dict(c["record"].get("artifacts") or {})
        if not artifacts.get("weights") or not self.logger:
            return
        record = {
            **self.ledger.record,
            "status": "completed",
            "metrics": c["metrics"],
            "protocol": c["protocol"],
            **c["record"],
        }
        metadata = json.loads(json.dumps(portable_paths(record, self.results_dir), default=str))
        try:
            reference = log_model(
                self.logger,
                local_path(artifacts["weights"], self.results_dir),
                self.ledger.run_id,
                metadata,
            )
        except WandbRefused as err:  # the upload step failed: said on stderr, in the entry and the line
            print(f"vitexp: {err}", file=sys.stderr)
            c["record"]["wandb_error"] = str(err)
            c["record"]["artifacts"] = {**artifacts, "wandb_model": None}
            return
        if reference:
            c["record"]["artifacts"] = {**artifacts, "wandb_model": reference}

    def _fail(self, err: BaseException) -> dict[str, Any]:
        self.entry_closing = True
        from vitexp.runs.loggers import finish

        invalid = isinstance(err, ConfigError) and self.ledger is None
        signame = self.signal or ("SIGINT" if isinstance(err, KeyboardInterrupt) else None)
        extra = {"output_dir": self.output_dir} if self.output_dir else {}
        if self.requeued:
            extra["requeued"] = self.requeued
        if invalid:
            remove_if_empty(self.output_dir)
        elif self.ledger is not None and self.ledger.record["status"] == "running":
            try:
                if signame:
                    self.ledger.interrupt(signame, **extra)
                else:
                    self.ledger.fail(err, **extra)
            except OSError as again:
                if again.errno not in NO_SPACE:
                    raise
                extra["entry"] = "running: not closed (no space), resume=auto closes it"
        finish(self._logger, failed=True)
        ledger = portable_path(self.ledger.path, self.results_dir) if self.ledger else None
        kept = (
            {"metrics": getattr(self, "pending_metrics", None), "pending": err.pending}
            if isinstance(err, EntryNotWritten)
            else {}
        )
        if "entry" in extra:
            kept["entry"] = extra["entry"]
        if signame:
            return {
                "status": "interrupted",
                "signal": signame,
                "error": f"interrupted by {signame}",
                "ledger": ledger,
            }
        return {
            "status": "invalid" if invalid else "failed",
            "error": portable_text(
                f"{type(err).__name__}: {one_line(err)}", self.results_dir, [self.output_dir]
            ),
            "ledger": ledger,
            **kept,
        }


@contextmanager
def owned_run(
    name: str,
    kind: str,
    results_dir: Path | str,
    output_dir: Path | str | None = None,
    logger_cfg: Mapping[str, Any] | None = None,
    resume: Any = False,
    job_type: str | None = None,
    resumable: bool = False,
    emits: bool = True,
) -> Iterator[Run]:
    """Own one run from start to last line (module docstring). The body calls ``run.start`` once
    its config is valid and ``run.complete`` at the end; the result is ``run.result``. Only a
    ``resumable`` run (training) keeps ``run.json`` in its folder and continues its entry.
    ``emits=False``: the caller prints the closing line (one command owning several runs, such as
    ``bench.compare``, closes with one line naming them all)."""
    from vitexp.runs.cpus import fit_threads

    fit_threads()  # torch's threads no more than the CPUs this process may use (vitexp.runs.cpus)
    run = Run(name, kind, results_dir, output_dir, logger_cfg, resume, job_type, resumable)
    restore = catch_signals(run)
    stopped_by: str | None = None
    try:
        yield run
        run.result = run._close()
    except ClosedFromPending:  # run.start closed the entry from the kept metrics: run.result holds them
        pass
    except BaseException as err:
        payload = run._fail(err)  # the entry is closed before SLURM's requeue kills the job
        if run.requeued and run.signal == "SIGUSR1":  # (submitit's SIGUSR2 has requeued the job itself)
            from vitexp.runs import slurm

            answer = slurm.requeue()  # every rank asks: a rank stuck in a collective cannot stop the others'
            if answer != run.requeued:
                print(f"vitexp: {answer}", file=sys.stderr)
        if run.rank_zero and emits:
            emit(payload)
        try:
            err.vitexp_reported = True  # the CLI prints no second closing line
            err.vitexp_results_dir, err.vitexp_run_dir = (
                run.results_dir,
                run.output_dir,
            )  # stderr names paths alike
        except AttributeError:
            pass
        if not (run.signal or isinstance(err, KeyboardInterrupt)):
            raise
        stopped_by = run.signal or "SIGINT"
    finally:
        restore()
        if run.lock is not None:
            run.lock.release()
    if run.deferred:
        print(
            f"vitexp: {', '.join(run.deferred)} while the run's entry closed: noted, not raised",
            file=sys.stderr,
        )
    if stopped_by is not None:
        pass_on(stopped_by)
    if run.rank_zero and emits:
        emit({"status": "completed", **run.result})
    if "SIGTERM" in run.deferred:  # asked to end while the entry closed completed: the process ends now
        pass_on("SIGTERM")
