"""What a table costs to train on GPUs, row by row, from its rehearsals (:mod:`vitexp.rehearsal`).

For each runnable row, the newest completed rehearsal of it (``<row name>+rehearsal``; one measured
on a GPU first) gives, per stage, the stage's epochs (the row's recipe), its seconds per optimiser
step at a per-device batch, and the FLOPs of one training step per image (counted: forward,
backward, a teacher's forward). The row's real dataset gives the images (:data:`DATASETS`).

- **measured** (the rehearsal ran on a GPU): GPU-hours = Σ_stages epochs × training images ×
  (seconds per step / per-device batch) / 3600, i.e. the GPU-time per image measured at the recipe's
  per-device batch, assumed to scale linearly over devices (DDP's all-reduce and the data loader are
  not in the step time). Evaluation is added as below.
- **estimate** (only a CPU rehearsal: CPU seconds say nothing about a GPU): GPU-hours = Σ_stages
  epochs × training images × training FLOPs per image / :data:`EFFECTIVE_TFLOPS`, a stated effective
  throughput (an H100 SXM's 989 dense bf16 TFLOP/s at an assumed 25 % utilisation, :data:`ASSUMED_GPU`);
  without a counted step, training FLOPs are 3 × the forward's (forward + backward). Closer to a lower
  bound than to a forecast: the data loader is not counted, and a detector (RoIAlign, NMS, 2 images
  per GPU) runs far below the assumed utilisation; a GPU rehearsal (``scripts/gpu_check.sh rehearse``)
  replaces the estimate by a measurement.
- Evaluation, both ways: the deployed model's forward (the rehearsal's ``gflops``) over the
  validation split after every epoch of each stage and the test split once, and for a k-NN row
  (:data:`KNN_METHODS`) over the training split too (the memory bank) at each evaluation, at the same
  effective throughput.

A table's cost is the sum of its rows, each × its seeds (the spec's ``seeds``). A row without a
completed rehearsal, or whose dataset size is unknown, is listed as such and left out of the sum
(the total says so). Decision: the output is a markdown file beside the table,
``results/tables/<table>.cost.md`` (:func:`write_cost`), written by ``vitexp-tables``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

#: Training / validation / test images of each dataset as the rows use it (source in the comment).
DATASETS: dict[str, dict[str, int]] = {
    "imagenet": {"train": 1_281_167, "val": 50_000, "test": 50_000},  # ILSVRC-2012; val is also the test split
    "cifar100": {"train": 49_000, "val": 1_000, "test": 10_000},      # 50,000 less data.val_fraction 0.02; CIFAR test set
    "coco": {"train": 118_287, "val": 5_000, "test": 5_000},          # COCO 2017 train2017 / val2017
    "fashion_mnist": {"train": 55_000, "val": 5_000, "test": 10_000},  # vitexp's fixed 5,000 validation images
}
#: The throughput an estimate assumes: vitexp's assumption, not a measurement (a GPU rehearsal replaces
#: it). 25 % of an H100 SXM's dense bf16 peak; ViT training at 224 px reaches well under half of the
#: peak (small models, attention and normalisations are memory-bound), and the data loader is not counted.
ASSUMED_GPU = "H100 SXM, bf16, 989 TFLOP/s dense peak at an assumed 25 % utilisation"
EFFECTIVE_TFLOPS = 989.0 * 0.25
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
    from vitexp.objectives import objective_for

    return objective_for(config).dataset_sizes(data)  # a dataset the objective generates


def rehearsal_of(ledger, name: str) -> dict[str, Any] | None:
    """The newest completed rehearsal of row ``name``, one measured on a GPU before any CPU one."""
    from vitexp.rehearsal import KIND
    from vitexp.rehearsal.plan import SUFFIX

    runs = [r for r in ledger.named(f"{name}{SUFFIX}") if r["kind"] == KIND and r["status"] == "completed"]
    gpu = [r for r in runs if str((r.get("metrics") or {}).get("device", "")).startswith("cuda")]
    return (gpu or runs or [None])[-1]


def row_cost(config: Mapping[str, Any], rehearsal: Mapping[str, Any]) -> dict[str, Any]:
    """GPU-hours of one run of the row whose composed config is ``config`` (module docstring):
    {gpu_hours, train_hours, eval_hours, basis (measured | estimate), device, stages: {stage: hours}}."""
    sizes = dataset_sizes(config)
    if sizes is None:
        raise ValueError(f"dataset {(config.get('data') or {}).get('name')!r}: size unknown (vitexp.cost.DATASETS)")
    m = rehearsal.get("metrics") or {}
    device = str(m.get("device") or "cpu")
    measured = device.startswith("cuda")
    fwd_gflops = float(m.get("gflops") or 0.0)
    per_stage, evaluations = {}, 1  # the test
    for stage, s in (m.get("stages") or {}).items():
        epochs = int(s.get("epochs") or 0)
        evaluations += epochs
        if measured and s.get("step_s") and s.get("batch"):
            seconds_per_image = float(s["step_s"]) / int(s["batch"])
        else:
            flops = s.get("train_gflops_per_image") or 3 * fwd_gflops
            seconds_per_image = float(flops) / (EFFECTIVE_TFLOPS * 1e3)
        per_stage[stage] = epochs * sizes["train"] * seconds_per_image / 3600
    eval_images = sizes["test"] + (evaluations - 1) * sizes["val"]
    if str((config.get("method") or {}).get("name")) in KNN_METHODS:
        eval_images += evaluations * sizes["train"]
    eval_hours = eval_images * fwd_gflops / (EFFECTIVE_TFLOPS * 1e3) / 3600
    train_hours = sum(per_stage.values())
    return {"gpu_hours": train_hours + eval_hours, "train_hours": train_hours, "eval_hours": eval_hours,
            "basis": "measured" if measured else "estimate", "device": device, "stages": per_stage,
            "rehearsal": rehearsal["run_id"], "step_s": m.get("step_s"), "batch_size": m.get("batch_size"),
            "peak_mb": m.get("cuda_max_allocated_mb") or m.get("peak_rss_mb"),
            "finished": str(rehearsal.get("finished") or "")[:10]}


def table_cost(spec: Mapping[str, Any], ledger) -> dict[str, Any]:
    """{rows: [{label, name, seeds, cost | missing}], total_gpu_hours, missing: [names], basis}."""
    from vitexp.rows import composed_config, job_arguments, runnable_rows

    rows, total, missing, bases = [], 0.0, [], set()
    for row, name, seeds in runnable_rows(spec):
        n = len(seeds) if seeds else 1
        entry = {"label": row["label"], "name": name, "runs": n}
        rehearsal = rehearsal_of(ledger, name)
        config = composed_config(job_arguments(row, seeded=False), None)
        if rehearsal is None or config is None:
            entry["missing"] = "no completed rehearsal" if rehearsal is None else "the row does not compose"
            missing.append(name)
        else:
            try:
                entry["cost"] = row_cost(config, rehearsal)
            except ValueError as err:
                entry["missing"] = str(err)
                missing.append(name)
            else:
                total += n * entry["cost"]["gpu_hours"]
                bases.add(entry["cost"]["basis"])
        rows.append(entry)
    return {"table": spec["name"], "rows": rows, "total_gpu_hours": total, "missing": missing,
            "basis": "/".join(sorted(bases)) or "none"}


def _hours(h: float) -> str:
    return f"{h:,.1f}" if h >= 1 else f"{h:.3f}"


def render_cost(cost: Mapping[str, Any]) -> str:
    """The cost as markdown: one line per row, the total, and how it was obtained."""
    lines = [f"# GPU cost of `{cost['table']}`", "",
             "| row | runs | GPU-hours per run | GPU-hours | basis | stages (GPU-hours per run) | rehearsal: s/step, "
             "batch, peak memory, date | rehearsal |",
             "|---|---:|---:|---:|---|---|---|---|"]
    for r in cost["rows"]:
        c = r.get("cost")
        if c is None:
            lines.append(f"| {r['label']} | {r['runs']} | — | — | {r['missing']} | | | |")
            continue
        stages = ", ".join(f"{k} {_hours(v)}" for k, v in c["stages"].items()) or "evaluation only"
        basis = "measured on " + c["device"][5:] if c["basis"] == "measured" else "estimate"
        step = f"{c['step_s']:.3f} s" if c.get("step_s") else "no timed step"
        memory = f"{c['peak_mb']:,.0f} MiB" if c.get("peak_mb") else "?"
        lines.append(f"| {r['label']} | {r['runs']} | {_hours(c['gpu_hours'])} | {_hours(r['runs'] * c['gpu_hours'])} "
                     f"| {basis} | {stages}; eval {_hours(c['eval_hours'])} | {step}, batch {c.get('batch_size')} on "
                     f"{c['device']}, {memory}, {c['finished']} | `{c['rehearsal']}` |")
    missing = f" ({len(cost['missing'])} row(s) without a cost left out)" if cost["missing"] else ""
    lines += ["", f"**Total: {_hours(cost['total_gpu_hours'])} GPU-hours**{missing}.", "",
              "Measured rows: GPU seconds per step over the per-device batch, × epochs × training images (linear "
              "scaling over devices assumed). Estimates: the FLOPs of one counted training step per image × epochs × "
              f"training images at {EFFECTIVE_TFLOPS:.0f} TFLOP/s ({ASSUMED_GPU}): an **estimate**, not a measurement, "
              "and closer to a lower bound: the data loader is not counted, and a detector (RoIAlign, NMS, 2 images "
              "per GPU) runs far below the assumed utilisation. "
              "Evaluation: the deployed model's forward over the validation split after each epoch, the test split, "
              "and for k-NN rows the training split (memory bank) per evaluation, at the same throughput "
              "(vitexp/cost.py)."]
    return "\n".join(lines) + "\n"


def write_cost(spec: Mapping[str, Any], ledger, out_dir: Path) -> Path | None:
    """``<out_dir>/<table>.cost.md`` when any row of the table has a rehearsal; its path, else ``None``."""
    from vitexp.ledger import atomic_write

    cost = table_cost(spec, ledger)
    if not any("cost" in r for r in cost["rows"]):
        return None
    return atomic_write(Path(out_dir) / f"{spec['name']}.cost.md", render_cost(cost))
