"""One row's GPU-hours, and a table's: the larger of the GPU's time and the loader's, phase by phase.

Its reasoning: docs/cluster.md, "vitexp/cost/rows.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from vitexp.cost.anchors import COLUMNS, cost_config, gpu_factors, row_anchor, seconds_per_image
from vitexp.cost.loader import cpus_per_task, loader_runs, rate_for, workers

#: Training / validation / test images of each dataset as the rows use it (source in the comment).
DATASETS: dict[str, dict[str, int]] = {
    "imagenet": {
        "train": 1_281_167,
        "val": 50_000,
        "test": 50_000,
    },  # ILSVRC-2012; val is also the test split
    "cifar100": {
        "train": 49_000,
        "val": 1_000,
        "test": 10_000,
    },  # 50,000 less data.val_fraction 0.02; CIFAR test set
    "coco": {"train": 118_287, "val": 5_000, "test": 5_000},  # COCO 2017 train2017 / val2017
    "fashion_mnist": {
        "train": 55_000,
        "val": 5_000,
        "test": 10_000,
    },  # vitexp's fixed 5,000 validation images
}
#: Methods whose evaluation forwards the training split too (the k-NN memory bank).
KNN_METHODS = ("knn", "saper_kd")


def dataset_sizes(config: Mapping[str, Any]) -> dict[str, int] | None:
    """{train, val, test} images of the row's data (``None``: unknown)."""
    data = config.get("data") or {}
    name = str(data.get("name"))
    if name in DATASETS:
        return DATASETS[name]
    if data.get("num_train") is not None:  # synthetic
        return {"train": int(data["num_train"]), "val": int(data["num_val"]), "test": int(data["num_test"])}
    from vitexp.training.objectives import objective_for

    return objective_for(config).dataset_sizes(data)  # a dataset the objective generates


def rehearsal_of(ledger, name: str) -> dict[str, Any] | None:
    """The newest completed rehearsal of row ``name``, one measured on a GPU before any CPU one."""
    from vitexp.cost.rehearsal import KIND
    from vitexp.cost.rehearsal.plan import SUFFIX

    runs = [r for r in ledger.named(f"{name}{SUFFIX}") if r["kind"] == KIND and r["status"] == "completed"]
    gpu = [r for r in runs if str((r.get("metrics") or {}).get("device", "")).startswith("cuda")]
    return (gpu or runs or [None])[-1]


@dataclass
class CostContext:
    """What every row of a cost shares: the target ``gpu``, the GPU ``factors``, the loader benches
    (``loader_runs``) and the cores a SLURM task gets (``cpus``, ``main_cores`` for the training process)."""

    gpu: str
    factors: dict[str, dict[str, Any]]
    loader_runs: list[dict[str, Any]] = field(default_factory=list)
    cpus: int = 10
    main_cores: int = 1

    @classmethod
    def of(cls, ledger=None, gpu: str | None = None, column: str | None = None) -> "CostContext":
        """The context of ``ledger``; ``column``: GPU factors from one of Lambda's columns alone."""
        cost = cost_config()
        return cls(
            gpu or str(cost["target_gpu"]),
            gpu_factors(ledger, cost, column),
            loader_runs(ledger),
            cpus_per_task(),
            int(cost.get("main_process_cores", 1)),
        )


def _phase(images: float, gpu_s: float, loader_s: float | None) -> dict[str, Any]:
    gpu_h = images * gpu_s / 3600
    loader_h = images * loader_s / 3600 if loader_s is not None else None
    return {
        "images": images,
        "gpu_hours": gpu_h,
        "loader_hours": loader_h,
        "hours": max(gpu_h, loader_h or 0.0),
    }


def _measured_here(rehearsal: Mapping[str, Any], ctx: CostContext) -> bool:
    """Whether the rehearsal ran on the target GPU (its step time is then the row's own measurement)."""
    device = str((rehearsal.get("metrics") or {}).get("device") or "")
    match = str((cost_config()["gpus"].get(ctx.gpu) or {}).get("match") or ctx.gpu)
    return device.startswith("cuda") and match.lower() in device.lower()


def row_cost(
    config: Mapping[str, Any], rehearsal: Mapping[str, Any], ctx: CostContext | None = None
) -> dict[str, Any]:
    """Hours of one run of the row whose composed config is ``config`` on ``ctx.gpu`` (module docstring)."""
    ctx = ctx or CostContext.of()
    sizes = dataset_sizes(config)
    if sizes is None:
        raise ValueError(
            f"dataset {(config.get('data') or {}).get('name')!r}: size unknown (vitexp.cost.DATASETS)"
        )
    m = rehearsal.get("metrics") or {}
    anchor = row_anchor(config)
    scaled = bool(cost_config()["anchors"][anchor.anchor.name].get("flops_scaled", True))
    measured = _measured_here(rehearsal, ctx)
    fwd = float(m.get("gflops") or 0.0)
    given = workers(config, ctx.cpus, ctx.main_cores)
    train_rate, eval_rate = (rate_for(config, split, ctx.loader_runs) for split in ("train", "eval"))
    stages, evaluations, needed, ratios = {}, 1, 0, {}
    for name, s in (m.get("stages") or {}).items():
        epochs = int(s.get("epochs") or 0)
        evaluations += epochs
        gflops = float(s.get("train_gflops_per_image") or 3 * fwd)
        ratios[name] = gflops / anchor.anchor.train_gflops
        if measured and s.get("step_s") and s.get("batch"):
            gpu_s = float(s["step_s"]) / int(s["batch"])
        else:
            gpu_s = seconds_per_image(
                anchor.anchor, gflops if scaled else anchor.anchor.train_gflops, ctx.gpu, ctx.factors
            )
        loader_s = 1.0 / (train_rate.per_worker * given) if train_rate else None
        stages[name] = _phase(epochs * sizes["train"], gpu_s, loader_s)
        if train_rate:
            needed = max(needed, math.ceil(1.0 / gpu_s / train_rate.per_worker))
    eval_images = sizes["test"] + (evaluations - 1) * sizes["val"]
    if str((config.get("method") or {}).get("name")) in KNN_METHODS:
        eval_images += evaluations * sizes["train"]
    eval_gpu_s = seconds_per_image(
        anchor.anchor, fwd if scaled else anchor.anchor.forward_gflops, ctx.gpu, ctx.factors, train=False
    )
    evaluation = _phase(eval_images, eval_gpu_s, 1.0 / (eval_rate.per_worker * given) if eval_rate else None)
    if not stages and eval_rate:  # an evaluation-only row (a k-NN bank): the workers its forward passes need
        needed = math.ceil(1.0 / eval_gpu_s / eval_rate.per_worker)
    phases = [*stages.values(), evaluation]
    hours, gpu_hours = sum(p["hours"] for p in phases), sum(p["gpu_hours"] for p in phases)
    loader_counted = [p["loader_hours"] for p in phases if p["loader_hours"] is not None]
    return {
        "gpu": ctx.gpu,
        "hours": hours,
        "gpu_hours": gpu_hours,
        "loader_hours": sum(loader_counted) if loader_counted else None,
        "bound": "loader" if hours > gpu_hours * (1 + 1e-9) else "GPU",
        "stages": stages,
        "eval": evaluation,
        "workers": given,
        "workers_needed": needed or None,
        "cores_needed": needed + ctx.main_cores if needed else None,
        "loader": {"train": train_rate, "eval": eval_rate},
        "decoder": (config.get("data") or {}).get("decoder"),
        "anchor": {
            "name": anchor.anchor.name,
            "relation": anchor.relation,
            "source": anchor.anchor.source,
            "scaled": scaled,
            "flops_ratio": ratios,
            "gpu": anchor.anchor.gpu,
            "train_tflops": (
                anchor.anchor.train_gflops
                / 1000
                / seconds_per_image(anchor.anchor, anchor.anchor.train_gflops, ctx.gpu, ctx.factors)
            ),
        },
        "basis": "measured" if measured else "anchored",
        "device": str(m.get("device") or "cpu"),
        "rehearsal": rehearsal["run_id"],
        "finished": str(rehearsal.get("finished") or "")[:10],
    }


def table_cost(spec: Mapping[str, Any], ledger, ctx: CostContext | None = None) -> dict[str, Any]:
    """{table, gpu, rows: [{label, name, runs, cost | missing}], total_hours, total_gpu_hours, missing,
    cores_needed (the most any row needs per GPU), loader_bound (rows), range_hours (the total's low and
    high with the GPU factors of Lambda's two columns alone)}."""
    ctx = ctx or CostContext.of(ledger)
    out = _table_cost(spec, ledger, ctx)
    ends = [
        _table_cost(spec, ledger, replace(ctx, factors=gpu_factors(ledger, None, c)))["total_hours"]
        for c in COLUMNS
    ]
    out["range_hours"] = (min(ends), max(ends))
    return out


def _table_cost(spec: Mapping[str, Any], ledger, ctx: CostContext) -> dict[str, Any]:
    from vitexp.config.rows import composed_config, job_arguments, runnable_rows

    rows, total, total_gpu, missing = [], 0.0, 0.0, []
    for row, name, seeds in runnable_rows(spec):
        n = len(seeds) if seeds else 1
        entry: dict[str, Any] = {"label": row["label"], "name": name, "runs": n}
        rehearsal = rehearsal_of(ledger, name)
        config = composed_config(job_arguments(row, seeded=False), None)
        if rehearsal is None or config is None:
            entry["missing"] = "no completed rehearsal" if rehearsal is None else "the row does not compose"
            missing.append(name)
        else:
            try:
                entry["cost"] = row_cost(config, rehearsal, ctx)
            except ValueError as err:
                entry["missing"] = str(err)
                missing.append(name)
            else:
                total += n * entry["cost"]["hours"]
                total_gpu += n * entry["cost"]["gpu_hours"]
        rows.append(entry)
    costs = [r["cost"] for r in rows if "cost" in r]
    return {
        "table": spec["name"],
        "gpu": ctx.gpu,
        "factors": ctx.factors,
        "cpus": ctx.cpus,
        "main_cores": ctx.main_cores,
        "rows": rows,
        "total_hours": total,
        "total_gpu_hours": total_gpu,
        "missing": missing,
        "cores_needed": max((c["cores_needed"] or 0 for c in costs), default=0) or None,
        "loader_bound": [r["label"] for r in rows if r.get("cost", {}).get("bound") == "loader"],
        "unmeasured_loader": [
            r["label"]
            for r in rows
            if "cost" in r and r["cost"]["loader"]["train"] is None and r["cost"]["stages"]
        ],
        "no_decoder": [r["label"] for r in rows if "cost" in r and not r["cost"]["decoder"]],
    }
