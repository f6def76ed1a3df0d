"""Loggers: W&B by default (online when logged in, offline otherwise; never waits on the network),
Lightning's CSVLogger, or none.

Its reasoning: docs/cluster.md, "vitexp/runs/loggers.py".
"""

from __future__ import annotations

import functools
import logging
import netrc
import os
import re
import unicodedata
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

from vitexp.errors import ConfigError

log = logging.getLogger(__name__)

#: Prefixes of the metrics the LightningModules log (accuracies among them as fractions).
LOGGED_SPLITS = ("train/", "val/", "test/")


def logged_fraction(key: str) -> bool:
    """A LightningModule's accuracy key (``val/top1``, ``test/top5``, ``val/ap_box``): a fraction
    that loggers, like the ledger, show in %."""
    name = key.rpartition("/")[2]
    return key.startswith(LOGGED_SPLITS) and (
        re.fullmatch(r"top\d+", name) is not None or name.startswith("ap")
    )


def in_percent(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with every :func:`logged_fraction` in %."""
    return {
        k: (
            100.0 * float(v)
            if logged_fraction(k) and isinstance(v, (int, float)) and not isinstance(v, bool)
            else v
        )
        for k, v in metrics.items()
    }


@functools.lru_cache(maxsize=None)
def percent_logger(base: type) -> type:
    """``base`` (a Lightning logger class) writing accuracies in % (:func:`in_percent`)."""

    class PercentLogger(base):
        #: The metrics prefix of the stage being fitted (:func:`stage_keys`): ``teacher_`` logs
        #: ``teacher_test/top1``, so the deployed stage's ``test/top1`` is the ledger's ``top1``.
        key_prefix: str = ""

        def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
            metrics = in_percent(metrics)
            if self.key_prefix:
                metrics = {
                    f"{self.key_prefix}{k}" if k.startswith(LOGGED_SPLITS) else k: v
                    for k, v in metrics.items()
                }
            super().log_metrics(metrics, step)

    PercentLogger.__name__ = PercentLogger.__qualname__ = f"Percent{base.__name__}"
    PercentLogger.__module__ = __name__  # found by pickle through the module's __getattr__
    return PercentLogger


def stage_keys(logger, prefix: str | None) -> None:
    """Log the next stage's ``train/``, ``val/`` and ``test/`` keys under its metrics ``prefix``
    (RAPTOR's ``teacher_``; None or ``""``: as logged), as the ledger names that stage's metrics."""
    if logger and hasattr(type(logger), "key_prefix"):
        logger.key_prefix = prefix or ""


def __getattr__(name: str) -> type:
    """``PercentWandbLogger`` / ``PercentCSVLogger`` by name (a pickled logger finds its class)."""
    if name.startswith("Percent") and name.endswith("Logger"):
        from lightning.pytorch import loggers

        return percent_logger(getattr(loggers, name[len("Percent") :]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_group(name: str) -> str:
    """A run's W&B group when ``logger.group`` is unset: its experiment (the name before ``+``)."""
    return name.split("+", 1)[0]


def run_tags(config: Mapping[str, Any] | None) -> list[str]:
    """``backbone=<name>``, ``method=<name>``, ``budget=<kind>[:<value>]`` of a run's config (W&B
    allows 64 characters a tag)."""
    config = config or {}
    tags = [
        f"{group}={(config.get(group) or {}).get('name')}"
        for group in ("backbone", "method")
        if (config.get(group) or {}).get("name")
    ]
    budget = dict(config.get("budget") or {})
    if budget.get("kind"):
        values = [str(v) for k, v in budget.items() if k != "kind"]
        tags.append(f"budget={budget['kind']}" + (f":{','.join(values)}" if values else ""))
    return [t[:64] for t in tags]


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


#: The modes W&B's settings accept (``wandb.sdk.wandb_settings.Settings.mode``).
WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")


def wandb_mode(configured: str | None) -> str:
    """``WANDB_MODE`` wins; then ``logger.mode``; then online if logged in, else offline. An empty
    ``WANDB_MODE`` (``export WANDB_MODE=``) means unset (a query: the environment is left as it is;
    :func:`drop_empty_wandb_mode` clears it where W&B starts); any other value outside
    :data:`WANDB_MODES` is a :class:`ConfigError`."""
    env = os.environ.get("WANDB_MODE") or ""
    if env.strip():  # a padded value is refused below, as W&B would refuse it
        if env not in WANDB_MODES:
            raise ConfigError(f"WANDB_MODE={env!r}: not a W&B mode; valid modes are {', '.join(WANDB_MODES)}")
        return "offline" if env == "dryrun" else env
    if configured:
        return str(configured)
    return "online" if wandb_logged_in() else "offline"


def drop_empty_wandb_mode() -> None:
    """Remove an empty ``WANDB_MODE`` from the environment before W&B starts: W&B's own settings
    read it and refuse the empty value, which :func:`wandb_mode` reads as unset."""
    if "WANDB_MODE" in os.environ and not os.environ["WANDB_MODE"].strip():
        del os.environ["WANDB_MODE"]


def build_logger(
    cfg: Mapping[str, Any],
    name: str,
    save_dir: Path,
    config: dict[str, Any] | None = None,
    job_type: str = "train",
    run_id: str | None = None,
):
    """A Lightning logger for ``cfg`` (the ``logger`` group), or ``False`` for none. ``run_id``:
    the W&B run id, resumed with ``resume="allow"`` (a requeued job continues its own W&B run);
    grouped and tagged as the module docstring says."""
    kind = cfg["kind"]
    if kind == "none":
        return False
    save_dir.mkdir(parents=True, exist_ok=True)
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return percent_logger(CSVLogger)(str(save_dir), name="csv", version="")
    if kind != "wandb":
        raise ValueError(f"logger.kind={kind!r}: valid kinds are wandb, csv, none")
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    mode = wandb_mode(cfg.get("mode"))
    drop_empty_wandb_mode()
    tags = list(dict.fromkeys([*(cfg.get("tags") or []), *run_tags(config)]))
    kwargs = dict(
        project=cfg.get("project", "vitexp"),
        entity=cfg.get("entity"),
        name=name,
        save_dir=str(save_dir),
        tags=tags,
        job_type=job_type,
        group=cfg.get("group") or run_group(name),
        config=config,
    )
    if run_id:
        kwargs.update(id=run_id, resume="allow")
    settings = wandb.Settings(init_timeout=float(cfg.get("init_timeout", 30)), silent=True)
    logger = percent_logger(WandbLogger)(mode=mode, settings=settings, **kwargs)
    if mode == "online":
        try:
            _ = logger.experiment  # start now, so a failure falls back before training
        except Exception as err:  # network down, auth refused, timeout
            log.warning("W&B online start failed (%s); continuing offline", err)
            logger = percent_logger(WandbLogger)(mode="offline", settings=settings, **kwargs)
    return logger


def run_url(run) -> str | None:
    """A W&B run's URL, or ``offline:<its folder>`` (what ``wandb sync`` uploads)."""
    if getattr(run, "offline", False):
        return f"offline:{getattr(run, 'dir', '')}"
    return getattr(run, "url", None)


def wandb_url(logger) -> str | None:
    try:
        from lightning.pytorch.loggers import WandbLogger

        if isinstance(logger, WandbLogger):
            return run_url(logger.experiment)
    except Exception:  # pragma: no cover - a broken W&B never fails a run
        return None
    return None


#: W&B's longest artifact name.
ARTIFACT_NAME_MAX = 128


def wandb_name(run_id: str) -> str:
    """The run id as W&B takes it in a name: letters, digits, ``-``, ``_`` and ``.`` of ASCII (an
    accented letter loses its accent, any other character is ``-``); the ledger records it beside the
    run id (``wandb_name``). The run id's random suffix keeps it unique."""
    out = []
    for char in run_id:
        if char.isascii() and (char.isalnum() or char in "-_."):
            out.append(char)
            continue
        plain = "".join(c for c in unicodedata.normalize("NFKD", char) if c.isascii() and c.isalnum())
        out.append(plain or "-")
    return re.sub(r"-{2,}", "-", "".join(out))


def model_artifact_name(run_id: str) -> str:
    """``weights-<wandb_name(run_id)>``, shortened to W&B's limit keeping the run id's random suffix."""
    safe = wandb_name(run_id)
    name = f"weights-{safe}"
    return name if len(name) <= ARTIFACT_NAME_MAX else name[: ARTIFACT_NAME_MAX - 7] + "-" + safe[-6:]


class WandbRefused(RuntimeError):
    """W&B refused a run's model artifact: the upload step failed (the run's weights are still on disk)."""


def log_model(logger, weights: Path, run_id: str, metadata: Mapping[str, Any]) -> str | None:
    """``weights`` as the W&B model artifact :func:`model_artifact_name` (file ``weights.pth``,
    ``metadata``: the run's ledger record) of the logger's run; an offline run keeps it for
    ``wandb sync``. Returns its reference ``[ENTITY/]PROJECT/NAME:latest`` (no entity offline: the
    default one when synced), ``None`` without a W&B logger; :class:`WandbRefused` naming the artifact
    when W&B refuses it (the caller records it: the run's metrics stand)."""
    from lightning.pytorch.loggers import WandbLogger

    if not isinstance(logger, WandbLogger):
        return None
    name = model_artifact_name(run_id)
    try:
        import wandb

        run = logger.experiment
        artifact = wandb.Artifact(name, type="model", metadata=dict(metadata))
        artifact.add_file(str(weights), name="weights.pth")
        run.log_artifact(artifact, aliases=["latest"])
        entity = None if getattr(run, "offline", False) else run.entity
        return "/".join(p for p in (entity, run.project, f"{artifact.name}:latest") if p)
    except Exception as err:  # noqa: BLE001 - W&B's own errors: the upload step fails, named
        from vitexp.errors import one_line

        raise WandbRefused(
            f"W&B refused the model artifact {name} of run {run_id}:"
            f" {type(err).__name__}: {one_line(err)[:300]}"
        ) from None


def fetch_model(reference: str, root: Path) -> dict[str, Any]:
    """The ledger record a W&B model artifact (:func:`log_model`) carries, with ``artifacts.weights``
    the ``weights.pth`` downloaded under ``root``. Raises ``FileNotFoundError`` in one line when W&B
    cannot give it (no login, an offline run not yet synced, no such artifact)."""
    import wandb

    try:
        artifact = wandb.Api().artifact(reference, type="model")
        folder = Path(artifact.download(root=str(root / artifact.name.replace(":", "-"))))
    except Exception as err:  # noqa: BLE001 - W&B's own errors, many lines
        from vitexp.errors import one_line

        raise FileNotFoundError(
            f"W&B artifact {reference}: {type(err).__name__}: {one_line(err)[:300]} (wandb login; "
            "an offline run's artifacts reach W&B with `wandb sync <run dir>/wandb/offline-run-*`)"
        ) from None
    record = dict(artifact.metadata)
    record["artifacts"] = {**(record.get("artifacts") or {}), "weights": str(folder / "weights.pth")}
    return record


def default_project() -> str:
    """``$WANDB_PROJECT``, else the project of ``conf/logger/wandb.yaml`` (where runs log)."""
    import yaml

    from vitexp import CONF_DIR

    return (
        os.environ.get("WANDB_PROJECT")
        or yaml.safe_load((CONF_DIR / "logger" / "wandb.yaml").read_text())["project"]
    )


def log_tables(written: Mapping[str, Mapping[str, str]], path: str | None, save_dir: Path) -> str | None:
    """Each table (its CSV, as a ``wandb.Table``) and its plot (``wandb.Image``) into one W&B run
    (job type ``tables``) of ``[ENTITY/]PROJECT`` (default: :func:`default_project`), online when
    logged in and offline otherwise (:func:`wandb_mode`; the run folder goes under ``save_dir``,
    ``$WANDB_DIR`` wins). Returns :func:`run_url`."""
    import csv

    import wandb

    entity, _, project = (path or "").rpartition("/")
    mode = wandb_mode(None)
    drop_empty_wandb_mode()
    run = wandb.init(
        entity=entity or None,
        project=project or default_project(),
        job_type="tables",
        name="tables",
        mode=mode,
        dir=os.environ.get("WANDB_DIR") or str(save_dir),
    )
    try:
        for name, files in written.items():
            with open(files["csv"], newline="") as fh:
                rows = list(csv.reader(fh))
            logged: dict[str, Any] = {f"{name}/table": wandb.Table(columns=rows[0], data=rows[1:])}
            if "png" in files:
                logged[f"{name}/plot"] = wandb.Image(files["png"])
            run.log(logged)
        return run_url(run)
    finally:
        run.finish()


def log_code_patch(logger, patch: Path | None) -> None:
    """A dirty tree's diff (the ledger's ``env.code_patch``) as the W&B run's code: the run's code is
    its commit plus this patch. Nothing for another logger; a failing W&B never fails a run."""
    try:
        from lightning.pytorch.loggers import WandbLogger

        if isinstance(logger, WandbLogger) and patch is not None and patch.is_file():
            logger.experiment.log_code(
                root=str(patch.parent), include_fn=lambda path, *_: Path(path).name == patch.name
            )
    except Exception as err:  # pragma: no cover - W&B's own trouble
        log.warning("W&B: the code patch was not logged (%s)", err)


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
