"""Which runs a table's rehearsal launches, and the overrides that turn a row into its rehearsal.

Its reasoning: docs/cluster.md, "vitexp/cost/rehearsal/plan.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from vitexp.config.rows import composed_config, job_arguments, runnable_rows
from vitexp.training.objectives import objective_for

KIND = "rehearsal"
SUFFIX = "+rehearsal"
#: The devices each trainer group rehearses on (``ddp``: one GPU; its DDP code path on one device).
DEVICES = {"cpu": 1, "gpu": 1, "ddp_cpu": 2, "ddp": 1}


@dataclass(frozen=True)
class Settings:
    """How a rehearsal runs: per-device ``batch`` (``None``: the recipe's), optimiser ``steps`` per
    stage, ``eval_batches`` for validation and the test, the ``trainer`` group."""

    batch: int | None = 2
    steps: int = 3
    eval_batches: int = 2
    trainer: str = "cpu"

    def __post_init__(self):
        if self.trainer not in DEVICES:
            raise ValueError(f"rehearsal trainer {self.trainer!r} is not one of {sorted(DEVICES)}")
        if self.steps < 2:
            raise ValueError(
                "a rehearsal needs at least 2 steps per stage (the first is counted, not timed); got"
                f" {self.steps}"
            )
        if (self.batch is not None and self.batch < 1) or self.eval_batches < 1:
            raise ValueError(
                f"batch ({self.batch}) and eval_batches ({self.eval_batches}) must be at least 1"
            )


@dataclass(frozen=True)
class Job:
    """One row's rehearsal: its row ``label`` and ledger ``name``, the Hydra ``arguments``, and the
    row's composed ``config`` (``None``: the row does not compose; ``error`` says why)."""

    label: str
    name: str
    arguments: list[str]
    config: dict[str, Any] | None
    error: str | None = None


def _batch_keys(node: Mapping[str, Any], prefix: str) -> Iterator[str]:
    for key, value in node.items():
        if isinstance(value, Mapping):
            yield from _batch_keys(value, f"{prefix}{key}.")
        elif key == "batch_size" and value is not None:
            yield f"{prefix}{key}"


def rehearsal_overrides(config: Mapping[str, Any], settings: Settings) -> list[str]:
    """The overrides that turn the row whose resolved config is ``config`` into its rehearsal
    (module docstring)."""
    devices = DEVICES[settings.trainer]
    batch = settings.batch or int(config["recipe"]["batch_size"])
    n_train, n_eval = batch * settings.steps * devices, batch * settings.eval_batches * devices
    precision = (config.get("trainer") or {}).get("precision") or "32-true"
    out = [
        f"trainer={settings.trainer}",
        f"trainer.devices={devices}",
        "trainer.num_nodes=1",
        f"trainer.precision={precision}",
        f"+trainer.max_steps={settings.steps}",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1",
        "logger=none",
        "eval.throughput=false",
        "backbone.pretrained=null",
        f"recipe.batch_size={batch}",
    ]
    out += objective_for(config).rehearsal_data(config, n_train, n_eval)
    method = config.get("method") or {}
    out += [f"method.{key}={batch}" for key in _batch_keys(method, "")]
    if method.get("phase_images") is not None:
        out.append(f"method.phase_images={min(int(method['phase_images']), n_train)}")
    out += [
        f"method.{key}=null"
        for key in ("teacher_probe_run", "surrogate", "probe_head", "cache_dir")
        if method.get(key) is not None
    ]
    return out


def rehearsal_jobs(
    spec: Mapping[str, Any], settings: Settings, overrides: list[str] | tuple[str, ...] = ()
) -> list[Job]:
    """One :class:`Job` per runnable row of ``spec`` (cited rows and rows without an experiment are
    not runs), in the spec's order; ``overrides`` are appended to every job (``results_dir=...``)."""
    jobs = []
    for row, name, seeds in runnable_rows(spec):
        base = [a for a in job_arguments(row, seeded=False) if not a.startswith("name=")]
        base += [f"seed={seeds[0]}"] if seeds else []
        config = composed_config(base, None)
        if config is None:
            jobs.append(Job(row["label"], f"{name}{SUFFIX}", base, None))
            continue
        # the row's data.* options belong to its real data: the rehearsal's synthetic data has its own
        own = [a for a in base if not a.lstrip("+~").startswith("data.")]
        arguments = [*own, *rehearsal_overrides(config, settings), f"name='{name}{SUFFIX}'", *overrides]
        jobs.append(Job(row["label"], f"{name}{SUFFIX}", arguments, config))
    return [
        j if j.config is not None else Job(j.label, j.name, j.arguments, None, _why(j.arguments))
        for j in jobs
    ]


def _why(job: list[str]) -> str:
    """Why ``job`` does not compose, in one line (composed again, outside :func:`composing`)."""
    from vitexp.config.composition import compose
    from vitexp.errors import one_line

    try:
        compose(job)
    except Exception as err:  # noqa: BLE001 - the reason is the message
        return f"the row's job ({' '.join(job)}) does not compose: {type(err).__name__}: {one_line(err)}"
    return f"the row's job ({' '.join(job)}) does not resolve"
