"""``vitexp-analyze splits --runs A B``: how much of a paired difference between two classifiers, and of
its change from the validation split to the test split, one fixed finite sample of images can account
for.

Its reasoning: docs/fashion-mnist.md, "vitexp/analysis/splits.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from lightning.pytorch.callbacks import Callback

from vitexp.errors import ConfigError

#: ``data`` keys that say how images are loaded, not which: ignored when two runs' splits are compared.
LOADER_KEYS = ("batch_size", "num_workers", "root", "package")
#: The splits compared, in order, as (name, ledger metric without its prefix).
SPLITS = (("val", "val_top1"), ("test", "top1"))
#: What the analysis reports, once, in its JSON file.
METHOD = (
    "Per-image top-1 correctness of each run's deployed model on its validation and test splits; per split: "
    "accuracies, paired difference a - b (percentage points), McNemar's b (only a right) and c (only b "
    "right), and a paired bootstrap over the split's images (the same resampled images score both models) "
    "of the difference: standard error and 95 % percentile interval. This is the image-sampling error of a "
    "fixed split given the two trained models; it does not include seed variation. Split gap = test "
    "difference - validation difference, se = sqrt(se_val^2 + se_test^2) from the two independent "
    "bootstraps, z = gap / se. by_class: the same per label, with closed-form standard errors "
    "(100 sd(a - b) / sqrt(n)), and predicted_a / predicted_b: each model's predictions for that label's "
    "images, counted per predicted label (a confusion-matrix row)."
)


def short_id(run_id: str) -> str:
    """The run's short id, the hex tail of its id (``...-77bdcb`` -> ``77bdcb``)."""
    return run_id.rsplit("-", 1)[-1]


def check_same_data(records: Sequence[Mapping[str, Any]]) -> None:
    """:class:`ConfigError` unless the runs' ``data`` configs agree outside :data:`LOADER_KEYS`."""
    a, b = [
        {k: v for k, v in (r["config"].get("data") or {}).items() if k not in LOADER_KEYS} for r in records
    ]
    if a != b:
        keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        raise ConfigError(
            f"runs {records[0]['run_id']} and {records[1]['run_id']} use different data "
            f"(data.{', data.'.join(keys)}: {[a.get(k) for k in keys]} vs {[b.get(k) for k in keys]}); "
            "splits compares two runs on the same validation and test images"
        )


class CorrectByImage(Callback):
    """Per image of each evaluated split, whether the model's top-1 is the label, in loader order:
    a forward hook on ``pl_module.model`` keeps each batch's logits for the batch's end."""

    def __init__(self) -> None:
        self.correct: dict[str, list[np.ndarray]] = {}
        self.labels: dict[str, list[np.ndarray]] = {}
        self.predicted: dict[str, list[np.ndarray]] = {}
        self._logits = None
        self._handle = None

    def _start(self, trainer, pl_module) -> None:
        self._handle = pl_module.model.register_forward_hook(
            lambda _m, _i, out: setattr(self, "_logits", out)
        )

    def _end(self, trainer, pl_module) -> None:
        self._handle.remove()

    def _batch(self, split: str, batch) -> None:
        logits, y = self._logits, batch[1]
        if logits is None or logits.ndim != 2 or len(logits) != len(y):
            raise RuntimeError(f"{split}: the model's output is not one row of logits per image")
        predicted = logits.argmax(-1)
        self.correct.setdefault(split, []).append((predicted == y).cpu().numpy())
        self.predicted.setdefault(split, []).append(predicted.cpu().numpy())
        self.labels.setdefault(split, []).append(y.cpu().numpy())
        self._logits = None

    on_validation_start = on_test_start = _start
    on_validation_end = on_test_end = _end

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self._batch("val", batch)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._batch("test", batch)


def predict(cfg, record: Mapping[str, Any], deployed) -> dict[str, Any]:
    """``{split: {"correct": bool array, "labels": int array, "predicted": int array, "size": n}}`` of run
    ``record``'s
    deployed model (:class:`vitexp.commands.evaluate.Deployed`) on its validation and test splits, each
    checked against what the module's own torchmetrics accuracy logged."""
    from omegaconf import open_dict

    from vitexp.training.build import build_trainer
    from vitexp.training.fit import stage_config

    objective, stage, model, datamodule_for, _ = deployed
    if objective.name != "auto" or stage.objective != "classify":
        raise ConfigError(
            f"run {record['run_id']}: splits compares classifiers (objective auto, a classify stage), "
            f"not objective {objective.name!r} stage {stage.objective!r}"
        )
    scfg = stage_config(cfg, stage).copy()
    with open_dict(scfg):  # every image of both splits
        scfg.trainer.limit_val_batches = scfg.trainer.limit_test_batches = None
        scfg.trainer.enable_progress_bar = False
    recorder = CorrectByImage()
    trainer = build_trainer(scfg, False, Path(cfg.output_dir), [recorder], test_only=True)
    module = objective.module(scfg, stage, model)
    datamodule = datamodule_for(scfg)
    logged = {
        "val": trainer.validate(module, datamodule=datamodule, verbose=False)[0]["val/top1"],
        "test": trainer.test(module, datamodule=datamodule, verbose=False)[0]["test/top1"],
    }
    out = {}
    for split, _ in SPLITS:
        correct, labels = np.concatenate(recorder.correct[split]), np.concatenate(recorder.labels[split])
        size = len(datamodule.val_set if split == "val" else datamodule.test_set)
        if len(correct) != size or abs(100.0 * correct.mean() - 100.0 * logged[split]) > 1e-4:
            raise RuntimeError(
                f"run {record['run_id']} {split}: {len(correct)} of {size} images recorded, "
                f"{100 * correct.mean():.4f} % against the module's {100 * logged[split]:.4f} %"
            )
        out[split] = {
            "correct": correct,
            "labels": labels,
            "size": size,
            "predicted": np.concatenate(recorder.predicted[split]),
            "indices": getattr(datamodule, "split_indices", {}).get(split),
        }
    return out


def paired_bootstrap(
    a: np.ndarray, b: np.ndarray, boot: int, rng: np.random.Generator, chunk: int = 128
) -> np.ndarray:
    """``boot`` replicates of 100 × (mean a − mean b) over the same n images drawn with replacement."""
    d = a.astype(np.int8) - b.astype(np.int8)
    out = np.empty(boot)
    for start in range(0, boot, chunk):
        idx = rng.integers(0, len(d), size=(min(chunk, boot - start), len(d)))
        out[start : start + len(idx)] = 100.0 * d[idx].mean(axis=1)
    return out


def compare_split(
    a: Mapping[str, Any], b: Mapping[str, Any], boot: int, rng: np.random.Generator
) -> dict[str, Any]:
    """One split's accuracies, paired difference, McNemar counts and bootstrap of the difference."""
    ca, cb = a["correct"], b["correct"]
    reps = paired_bootstrap(ca, cb, boot, rng)
    low, high = np.percentile(reps, [2.5, 97.5])
    return {
        "images": int(len(ca)),
        "top1_a": 100.0 * float(ca.mean()),
        "top1_b": 100.0 * float(cb.mean()),
        "diff": 100.0 * float(ca.mean() - cb.mean()),
        "only_a": int(np.sum(ca & ~cb)),
        "only_b": int(np.sum(~ca & cb)),
        "both": int(np.sum(ca & cb)),
        "neither": int(np.sum(~ca & ~cb)),
        "se": float(np.std(reps, ddof=1)),
        "ci95": [float(low), float(high)],
    }


def paired_se(a: np.ndarray, b: np.ndarray) -> float:
    """The closed-form standard error (percentage points) of the paired difference of two correctness
    arrays over the same images: 100 · sd(a − b) / √n."""
    d = a.astype(np.int8) - b.astype(np.int8)
    return 100.0 * float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0


def by_class(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per label: each split's images, accuracies and paired difference a − b with its closed-form se
    (:func:`paired_se`), and the gap test − val with se √(se_val² + se_test²) and z: where in the
    label space a split gap sits (a gap carried by one class points at its images, one spread over
    every class at the split as a whole), and what each model predicted for that label's images
    (``predicted_a``, ``predicted_b``: counts per predicted label, a confusion-matrix row; where the
    extra misses of one split go)."""
    out = []
    labels = np.unique(np.concatenate([runs[0][s]["labels"] for s, _ in SPLITS]))
    width = int(max(labels.max(), *(r[s]["predicted"].max() for r in runs for s, _ in SPLITS))) + 1
    for label in labels:
        row: dict[str, Any] = {"label": int(label)}
        for split, _ in SPLITS:
            mask = runs[0][split]["labels"] == label
            ca, cb = runs[0][split]["correct"][mask], runs[1][split]["correct"][mask]
            row[split] = {
                "images": int(mask.sum()),
                "top1_a": 100.0 * float(ca.mean()) if mask.any() else None,
                "top1_b": 100.0 * float(cb.mean()) if mask.any() else None,
                "diff": 100.0 * float(ca.mean() - cb.mean()) if mask.any() else None,
                "se": paired_se(ca, cb),
                "predicted_a": np.bincount(runs[0][split]["predicted"][mask], minlength=width).tolist(),
                "predicted_b": np.bincount(runs[1][split]["predicted"][mask], minlength=width).tolist(),
            }
        if row["val"]["diff"] is not None and row["test"]["diff"] is not None:
            gap, se = (
                row["test"]["diff"] - row["val"]["diff"],
                float(np.hypot(row["val"]["se"], row["test"]["se"])),
            )
            row["gap"] = {"diff": gap, "se": se, "z": gap / se if se > 0 else None}
        out.append(row)
    return out


def check_same_images(runs: Sequence[Mapping[str, Any]], ids: Sequence[str]) -> None:
    """:class:`ConfigError` unless both runs saw the same images of each split, in order (labels and,
    where the datamodule exposes them, split indices)."""
    for split, _ in SPLITS:
        pa, pb = runs[0][split], runs[1][split]
        same = pa["size"] == pb["size"] and np.array_equal(pa["labels"], pb["labels"])
        if pa["indices"] is not None and pb["indices"] is not None:
            same = same and np.array_equal(pa["indices"], pb["indices"])
        if not same:
            raise ConfigError(
                f"runs {ids[0]} and {ids[1]}: their {split} splits are not the same images in the "
                f"same order ({pa['size']} and {pb['size']} images)"
            )


def analyse(
    runs: Sequence[Mapping[str, Any]],
    records: Sequence[Mapping[str, Any]],
    prefixes: Sequence[str],
    boot: int,
    seed: int,
) -> dict[str, Any]:
    """The report: per split the comparison of run a with run b (:func:`compare_split`) beside each
    run's ledger value, and the split gap test − val with its standard error and z."""
    if boot < 2:
        raise ConfigError(f"--boot {boot}: at least 2 bootstrap replicates")
    ids = [r["run_id"] for r in records]
    check_same_images(runs, ids)
    rng = np.random.default_rng(seed)
    report: dict[str, Any] = {
        "runs": {"a": ids[0], "b": ids[1]},
        "experiments": {"a": records[0]["experiment"], "b": records[1]["experiment"]},
        "boot": boot,
        "seed": seed,
        "unit": "percentage points",
    }
    for split, key in SPLITS:
        row = compare_split(runs[0][split], runs[1][split], boot, rng)
        for side, record, prefix in zip("ab", records, prefixes):
            row[f"ledger_top1_{side}"] = (record.get("metrics") or {}).get(f"{prefix}{key}")
        report[split] = row
    gap = report["test"]["diff"] - report["val"]["diff"]
    se = float(np.hypot(report["test"]["se"], report["val"]["se"]))
    report["gap"] = {"diff": gap, "se": se, "z": gap / se if se > 0 else None}
    report["by_class"] = by_class(runs)
    report["method"] = METHOD
    return report


def summary(report: Mapping[str, Any]) -> str:
    """One line: each split's difference ± se (b, c) and the gap with its z."""
    parts = [
        f"{split} {r['diff']:+.2f} ± {r['se']:.2f} pp (b {r['only_a']}, c {r['only_b']}, n {r['images']})"
        for split, r in ((s, report[s]) for s, _ in SPLITS)
    ]
    gap = report["gap"]
    z = "n/a" if gap["z"] is None else f"{gap['z']:.2f}"
    return (
        f"splits {short_id(report['runs']['a'])} - {short_id(report['runs']['b'])}: "
        + ", ".join(parts)
        + f"; gap test - val {gap['diff']:+.2f} ± {gap['se']:.2f} pp (z {z})"
    )
