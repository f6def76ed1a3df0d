"""The measured rates GPU-hours are anchored on (``conf/cost.yaml``), and the GPU factor table.

Its reasoning: docs/cluster.md, "vitexp/cost/anchors.py".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping

#: The anchor whose measured training rate on a GPU calibrates that GPU's factor.
CALIBRATION_ANCHOR = "deit_small_patch16_224"
#: The experiment ``scripts/gpu_check.sh anchor`` times it as (its backbone is the anchor).
CALIBRATION_EXPERIMENT = "deit_small_baseline"


@functools.lru_cache(maxsize=1)
def cost_config() -> dict[str, Any]:
    """``conf/cost.yaml``."""
    import yaml

    from vitexp import CONF_DIR

    return yaml.safe_load((CONF_DIR / "cost.yaml").read_text())


@dataclass(frozen=True)
class Anchor:
    """A measured model: ``name``, its ``gpu``, training and inference images/s there, counted FLOPs."""

    name: str
    gpu: str
    train_images_per_s: float
    infer_images_per_s: float
    train_gflops: float
    forward_gflops: float
    source: str

    @classmethod
    def named(cls, name: str, config: Mapping[str, Any] | None = None) -> "Anchor":
        config = config or cost_config()
        a = config["anchors"].get(name)
        if a is None:
            raise ValueError(
                f"cost anchor {name!r} is not in conf/cost.yaml; anchors: {sorted(config['anchors'])}"
            )
        counted = a.get("counted") or {}
        if counted.get("train_gflops") is None or counted.get("forward_gflops") is None:
            raise ValueError(
                f"cost anchor {name!r}: its FLOPs are not counted (conf/cost.yaml anchors.{name}.counted; "
                "vitexp.cost.anchors.count_anchor)"
            )
        timm = config.get("timm_files") or {}
        source = a.get("source") or (
            f"{timm.get('repo')} {timm.get('train')} line {a['train']['line']} (training) and "
            f"{timm.get('infer')} line {a['infer']['line']} (inference) @ {timm.get('commit')}, "
            f"{a['gpu']}"
        )
        return cls(
            name,
            a["gpu"],
            float(a["train"]["images_per_s"]),
            float(a["infer"]["images_per_s"]),
            float(counted["train_gflops"]),
            float(counted["forward_gflops"]),
            source,
        )


@dataclass(frozen=True)
class RowAnchor:
    """The anchor a row is timed from and how (``same``, ``sibling``, ``published``, ``flops-only``)."""

    anchor: Anchor
    relation: str


def row_anchor(config: Mapping[str, Any], cost: Mapping[str, Any] | None = None) -> RowAnchor:
    """The anchor of the row whose composed config is ``config`` (module docstring)."""
    from vitexp.training.objectives import objective_for

    cost = cost or cost_config()
    own = objective_for(config).cost_anchor(config)
    if own is not None:
        return RowAnchor(Anchor.named(own, cost), "published")
    entry = (cost.get("backbones") or {}).get(str((config.get("backbone") or {}).get("name")))
    if entry is not None:
        return RowAnchor(Anchor.named(entry["anchor"], cost), str(entry["relation"]))
    return RowAnchor(Anchor.named(cost["flops_only"], cost), "flops-only")


#: Lambda's two columns; a factor from one alone bounds the range of the geometric mean.
COLUMNS = ("resnet50", "bert_base_squad")


def lambda_factor(entry: Mapping[str, Any], reference: Mapping[str, Any], column: str | None = None) -> float:
    """sqrt(resnet50 ratio × bert_base_squad ratio) of ``entry`` to ``reference`` (conf/cost.yaml); with
    ``column``, that column's ratio alone (one end of the factor's range). Refuses another column."""
    if column is not None:
        if column not in COLUMNS:
            raise ValueError(f"column {column!r} is not one of Lambda's columns {COLUMNS}")
        return entry[column] / reference[column]
    return math.sqrt(
        entry["resnet50"] / reference["resnet50"] * entry["bert_base_squad"] / reference["bert_base_squad"]
    )


def measured_gpus(ledger) -> dict[str, dict[str, Any]]:
    """{torch device name: the newest completed ``bench.mode=train_step`` run of the calibration
    anchor's experiment on that GPU} from ``ledger`` (``None``: no ledger)."""
    out: dict[str, dict[str, Any]] = {}
    if ledger is None:
        return out
    for run in ledger.named(CALIBRATION_EXPERIMENT):
        protocol = run.get("protocol") or {}
        if (
            run.get("kind") == "bench"
            and run.get("status") == "completed"
            and protocol.get("mode") == "train_step"
            and str(protocol.get("device", "")).startswith("cuda")
        ):
            out[str(protocol.get("device_name"))] = run
    return out


def gpu_factors(
    ledger=None, cost: Mapping[str, Any] | None = None, column: str | None = None
) -> dict[str, dict[str, Any]]:
    """{GPU: {factor (RTX 3090 = 1), basis, source}}: the table's GPUs (module docstring), each replaced
    by a DeiT-S training rate measured on it; a measured GPU outside the table is added under its name;
    ``column``: Lambda's factors from that column alone (:func:`lambda_factor`)."""
    cost = cost or cost_config()
    gpus = cost["gpus"]
    reference = gpus["RTX 3090"]
    out = {
        name: {
            "factor": lambda_factor(g, reference, column),
            "basis": "vendor benchmark",
            "source": (
                f"{cost['gpu_source']} line {g['line']}, geometric mean of resnet50 and bert_base_squad"
            ),
        }
        for name, g in gpus.items()
    }
    out["RTX 3090"]["source"] = "the GPU of timm's benchmark files (factor 1)"
    anchor = Anchor.named(CALIBRATION_ANCHOR, cost)
    for device_name, run in measured_gpus(ledger).items():
        name = next(
            (k for k, g in gpus.items() if str(g["match"]).lower() in device_name.lower()), device_name
        )
        rate = float(run["metrics"]["train_images_per_s"])
        out[name] = {
            "factor": rate / anchor.train_images_per_s * out.get(anchor.gpu, {"factor": 1.0})["factor"],
            "basis": "measured",
            "source": (
                f"DeiT-S trained at {rate:,.0f} images/s on {device_name} "
                f"(run {run['run_id']}) over timm's {anchor.train_images_per_s:,.1f}"
            ),
        }
    return out


def seconds_per_image(
    anchor: Anchor, gflops: float, gpu: str, factors: Mapping[str, Mapping[str, Any]], train: bool = True
) -> float:
    """GPU-seconds per image on ``gpu`` of a model of ``gflops`` (training step or forward, as ``train``),
    timed from ``anchor`` (module docstring)."""
    if gpu not in factors:
        raise ValueError(
            f"GPU {gpu!r} has no factor; GPUs: {sorted(factors)} (conf/cost.yaml gpus, or a "
            "measured DeiT-S training rate: scripts/gpu_check.sh anchor)"
        )
    rate = anchor.train_images_per_s if train else anchor.infer_images_per_s
    ratio = gflops / (anchor.train_gflops if train else anchor.forward_gflops)
    return ratio / rate * factors[anchor.gpu]["factor"] / factors[gpu]["factor"]


def count_anchor(name: str) -> dict[str, float]:
    """{train_gflops, forward_gflops} of anchor ``name`` counted as a row's are (``conf/cost.yaml``
    says how): a timm model at its ``img_size``, or an objective's published reference model."""
    cost = cost_config()
    a = cost["anchors"][name]
    if a.get("count"):  # an objective's reference model counts itself ("module:function")
        import importlib

        module, _, function = str(a["count"]).partition(":")
        return getattr(importlib.import_module(module), function)(tuple(a["img_size"]))
    import timm
    import torch

    from vitexp.measure.flops import count_macs, flop_counting

    model = timm.create_model(name, pretrained=False, num_classes=1000)
    img = int(a["img_size"])
    forward = 2 * count_macs(model, img).gmacs
    model.train()
    x, y = torch.randn(2, 3, img, img), torch.tensor([0, 1])
    stack, counter = flop_counting()
    with stack:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return {"train_gflops": counter.get_total_flops() / 2 / 1e9, "forward_gflops": forward}
