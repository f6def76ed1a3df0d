"""Loggers: W&B by default (online when logged in, offline otherwise; never waits on the
network), Lightning's CSVLogger, or none."""
from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

log = logging.getLogger(__name__)


def wandb_logged_in() -> bool:
    """True when W&B credentials exist locally (``WANDB_API_KEY`` or a ``~/.netrc`` entry for the
    W&B host); checked without any network access."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(configured: str | None) -> str:
    """``WANDB_MODE`` wins; then ``logger.mode``; then online if logged in, else offline."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return "offline" if env == "dryrun" else env
    if configured:
        return str(configured)
    return "online" if wandb_logged_in() else "offline"


def build_logger(cfg: Mapping[str, Any], name: str, save_dir: Path, config: dict[str, Any] | None = None,
                 job_type: str = "train", run_id: str | None = None):
    """A Lightning logger for ``cfg`` (the ``logger`` group), or ``False`` for none. ``run_id``:
    the W&B run id, resumed with ``resume="allow"`` (a requeued job continues its own W&B run);
    ``logger.group`` and ``logger.tags`` group a sweep's runs by table."""
    kind = cfg["kind"]
    if kind == "none":
        return False
    save_dir.mkdir(parents=True, exist_ok=True)
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(str(save_dir), name="csv", version="")
    if kind != "wandb":
        raise ValueError(f"logger.kind={kind!r}: valid kinds are wandb, csv, none")
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    mode = wandb_mode(cfg.get("mode"))
    kwargs = dict(project=cfg.get("project", "vitexp"), entity=cfg.get("entity"), name=name,
                  save_dir=str(save_dir), tags=list(cfg.get("tags") or []), job_type=job_type,
                  group=cfg.get("group"), config=config)
    if run_id:
        kwargs.update(id=run_id, resume="allow")
    settings = wandb.Settings(init_timeout=float(cfg.get("init_timeout", 30)), silent=True)
    logger = WandbLogger(mode=mode, settings=settings, **kwargs)
    if mode == "online":
        try:
            _ = logger.experiment  # start now, so a failure falls back before training
        except Exception as err:  # network down, auth refused, timeout
            log.warning("W&B online start failed (%s); continuing offline", err)
            logger = WandbLogger(mode="offline", settings=settings, **kwargs)
    return logger


def wandb_url(logger) -> str | None:
    try:
        from lightning.pytorch.loggers import WandbLogger

        if isinstance(logger, WandbLogger):
            run = logger.experiment
            if getattr(run, "offline", False):
                return f"offline:{getattr(run, 'dir', '')}"
            return getattr(run, "url", None)
    except Exception:  # pragma: no cover - a broken W&B never fails a run
        return None
    return None


def log_final(logger, metrics: Mapping[str, Any], step: int | None = None) -> None:
    """Final metrics to the logger (and to the W&B run summary)."""
    if not logger:
        return
    numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    logger.log_metrics({f"final/{k}": v for k, v in numeric.items()}, step=step)
    try:
        from lightning.pytorch.loggers import WandbLogger

        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update(dict(metrics))
    except Exception as err:  # pragma: no cover - a broken W&B never fails a finished run
        log.warning("W&B summary update failed: %s", err)
    logger.save()


def finish(logger, failed: bool = False) -> None:
    """Close the logger; a W&B run of a failed vitexp run is marked failed (exit code 1)."""
    if not logger:
        return
    try:
        from lightning.pytorch.loggers import WandbLogger

        if isinstance(logger, WandbLogger):
            logger.finalize("failed" if failed else "success")
            logger.experiment.finish(exit_code=1 if failed else 0)
    except Exception as err:  # pragma: no cover - a broken W&B never fails a finished run
        log.warning("W&B finish failed: %s", err)
