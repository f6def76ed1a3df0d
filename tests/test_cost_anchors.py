"""Every published number the cost model stands on, pinned here as a literal with its source, independent
of conf/cost.yaml: a changed anchor, GPU column, published time or measured loader rate fails, and each
mutation of one of them is shown failing (issue 59)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from vitexp import PROJECT_ROOT
from vitexp.cost import anchors
from vitexp.ledger import Ledger

#: Lambda's PyTorch training benchmark, lambdal/deeplearning-benchmark
#: pytorch/pytorch-train-throughput-fp16.csv @ aa5addb6a53675a649a80036dad548f1c27cbcc4:
#: {GPU: (line, resnet50 images/s, bert_base_squad sequences/s)}.
LAMBDA = {
    "RTX 3090": (4, 905.0, 172.0),
    "V100": (3, 833.0, 189.0),
    "A100": (8, 1582.0, 443.0),
    "H100": (14, 2616.0, 812.0),
}

#: timm's benchmark files, huggingface/pytorch-image-models @ aa4b5850c1543fa488abf260f18390eda46cf85d,
#: results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv (train) and
#: results/benchmark-infer-amp-nchw-pt113-cu117-rtx3090.csv (infer):
#: {model: {split: (images/s, batch, line)}}.
TIMM = {
    "deit_tiny_patch16_224": {"train": (2290.53, 512, 49), "infer": (7398.73, 1024, 79)},
    "deit_small_patch16_224": {"train": (1053.64, 384, 179), "infer": (3209.05, 1024, 223)},
    "vit_small_patch16_224": {"train": (1052.92, 384, 180), "infer": (3199.98, 1024, 224)},
    "deit_base_patch16_224": {"train": (390.88, 192, 488), "infer": (1208.56, 1024, 557)},
    "vit_base_patch16_224": {"train": (390.86, 192, 489), "infer": (1209.0, 1024, 555)},
}

#: torchvision's Mask R-CNN R50-FPN, pytorch/vision docs/source/models.rst @
#: 00542d95486feb18bda93ab6b8b7a694291151e9, "Runtime characteristics": 8 V100s, 2 images per GPU in
#: training, 1 in testing; seconds per iteration.
TORCHVISION_MASKRCNN = {"train_s_per_it": 0.2728, "test_s_per_it": 0.0903}

#: Published training times: DeiT (arXiv 2012.12877, "Training time": DeiT-S less than 3 days on 4 GPUs;
#: DeiT-B 53 hours on 8); detectron2 MODEL_ZOO.md @ 02b5c4e295e990042a714712c21dc79b731e8833 line 351
#: (mask_rcnn_R_50_FPN_1x, 0.261 s/iter on 8 V100s) with configs/Base-RCNN-FPN.yaml (16 images per
#: iteration, 90,000 iterations).
PUBLISHED_TIMES = {
    "deit_small_300": {"hours": 72, "gpus": 4, "epochs": 300, "kind": "upper_bound"},
    "deit_base_300": {"hours": 53, "gpus": 8, "epochs": 300, "kind": "point"},
    "maskrcnn_r50_fpn_1x": {
        "hours": 0.261 * 90_000 / 3600,
        "gpus": 8,
        "images": 90_000 * 16,
        "kind": "point",
    },
}

#: The Lambda factors these literals give (geometric mean of the two columns' ratios to the RTX 3090),
#: each with its low and high column (arithmetic, 3 decimals).
FACTORS = {"H100": (3.694, 2.891, 4.721), "A100": (2.122, 1.748, 2.576), "V100": (1.006, 0.920, 1.099)}


def mismatches(cost: dict[str, Any]) -> list[str]:
    """Where ``cost`` (conf/cost.yaml as read) departs from the literals above."""
    out = []
    for gpu, (line, resnet, bert) in LAMBDA.items():
        entry = cost["gpus"][gpu]
        if (entry.get("line"), entry["resnet50"], entry["bert_base_squad"]) != (line, resnet, bert):
            out.append(f"gpus.{gpu}")
    for model, splits in TIMM.items():
        for split, (rate, batch, line) in splits.items():
            entry = cost["anchors"][model][split]
            if (entry["images_per_s"], entry["batch"], entry["line"]) != (rate, batch, line):
                out.append(f"anchors.{model}.{split}")
    mask = cost["anchors"]["maskrcnn_r50_fpn"]
    if round(mask["train"]["images_per_s"], 3) != round(2 / TORCHVISION_MASKRCNN["train_s_per_it"], 3):
        out.append("anchors.maskrcnn_r50_fpn.train")
    if round(mask["infer"]["images_per_s"], 3) != round(1 / TORCHVISION_MASKRCNN["test_s_per_it"], 3):
        out.append("anchors.maskrcnn_r50_fpn.infer")
    for name, want in PUBLISHED_TIMES.items():
        entry = cost["validation"][name]
        if any(entry[k] != v for k, v in want.items() if k != "hours") or not math.isclose(
            entry["hours"], want["hours"], rel_tol=1e-9
        ):
            out.append(f"validation.{name}")
    return out


def test_conf_cost_yaml_holds_every_published_number_as_read():
    assert mismatches(anchors.cost_config()) == []


def test_the_gpu_factors_and_their_ranges_are_lambdas_two_columns():
    factors = anchors.gpu_factors(None)
    for gpu, (central, low, high) in FACTORS.items():
        assert round(factors[gpu]["factor"], 3) == central, gpu
        _, r, b = LAMBDA[gpu]
        assert (round(r / 905.0, 3), round(b / 172.0, 3)) == (low, high)  # the literals' own arithmetic


def _numbers(node: Any, path: tuple = ()) -> list[tuple]:
    """Every numeric leaf of a config node: (path, value)."""
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _numbers(v, (*path, k))]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return [(path, node)]
    return []


PINNED = [
    path
    for section in ("gpus", "anchors", "validation")
    for path, _ in _numbers(anchors.cost_config()[section], (section,))
    if path[-1]
    in ("resnet50", "bert_base_squad", "images_per_s", "batch", "line", "hours", "gpus", "epochs", "images")
]


@pytest.mark.parametrize("path", PINNED, ids=lambda p: ".".join(map(str, p)))
def test_a_mutated_published_number_fails(path):
    """Each published number of conf/cost.yaml, multiplied by 1.1 (or moved by one), is caught."""
    cost = copy.deepcopy(anchors.cost_config())
    node = cost
    for key in path[:-1]:
        node = node[key]
    value = node[path[-1]]
    node[path[-1]] = value + 1 if isinstance(value, int) else value * 1.1
    assert mismatches(cost), path


#: The loader rates the committed ledger measured (images/s per worker, the median over its bench runs):
#: {(split, resolution, RandAugment, random erasing, decoder): rate}, as vitexp.cost.loader reads them.
def _loader_rates(runs: list[dict[str, Any]]) -> dict[tuple, float]:
    from vitexp.cost import loader

    keys = {
        (*loader._bench_key(run.get("protocol") or {}), decoder)
        for run in runs
        for decoder in (run.get("protocol") or {}).get("decoders") or []
    }
    rates = {key: loader.rate_for(_config_for(key), key[0], runs) for key in keys}
    return {key: round(rate.per_worker, 1) for key, rate in rates.items() if rate is not None}


def _config_for(key: tuple) -> dict[str, Any]:
    split, img, aa, re_, decoder = key
    return {
        "backbone": {"img_size": img},
        "data": {"decoder": decoder, "auto_augment": aa, "random_erase": re_},
    }


def test_the_measured_loader_rates_are_pinned():
    """A loader rate that moved (a bench rerun, a changed median rule) changes every loader-bound row's
    hours: the committed rates are pinned here; the same runs with their rates 3 times faster fail."""
    from vitexp.cost import loader

    runs = loader.loader_runs(Ledger.load(PROJECT_ROOT / "results"))
    assert _loader_rates(runs) == LOADER_RATES
    faster = copy.deepcopy(runs)
    for run in faster:
        for key in run["metrics"]:
            if key.endswith("_images_per_s_per_worker"):
                run["metrics"][key] *= 3
    assert all(_loader_rates(faster)[k] != v for k, v in LOADER_RATES.items())


#: Images/s per worker on this project's 2-core machine (the committed vitexp-bench bench.mode=loader runs):
#: {(split, resolution, RandAugment, random erasing, decoder): median}.
LOADER_RATES: dict[tuple, float] = {
    ("eval", 224, None, 0.0, "pil"): 156.7,
    ("eval", 224, None, 0.0, "tensor"): 248.3,
    ("eval", 256, None, 0.0, "pil"): 131.8,
    ("eval", 256, None, 0.0, "tensor"): 225.1,
    ("train", 224, "rand-m9-mstd0.5-inc1", 0.25, "pil"): 152.4,
    ("train", 224, "rand-m9-mstd0.5-inc1", 0.25, "tensor"): 185.5,
    ("train", 224, None, 0.0, "pil"): 164.7,
    ("train", 224, None, 0.0, "tensor"): 238.9,
    ("train", 256, "rand-m9-mstd0.5-inc1", 0.25, "pil"): 133.4,
    ("train", 256, "rand-m9-mstd0.5-inc1", 0.25, "tensor"): 173.2,
}


def test_a_tables_hours_carry_the_range_of_the_gpu_factor():
    """Each end of the range is the table costed with one of Lambda's columns alone: a GPU-bound table
    (COCO) spreads around its central value, a loader-bound one (every bspf_table1 row) does not move."""
    from vitexp.cost import table_cost
    from vitexp.report.tables import load_spec

    for gpu, (_, low, high) in FACTORS.items():
        ends = [round(anchors.gpu_factors(None, column=c)[gpu]["factor"], 3) for c in anchors.COLUMNS]
        assert ends == [low, high], gpu
    with pytest.raises(ValueError, match="not one of Lambda's columns"):
        anchors.gpu_factors(None, column="vgg16")
    ledger = Ledger.load(PROJECT_ROOT / "results")
    coco = table_cost(load_spec("bspf_coco"), ledger)
    low, high = coco["range_hours"]
    assert low < coco["total_hours"] < high and high / low > 1.2
    table1 = table_cost(load_spec("bspf_table1"), ledger)
    assert table1["range_hours"] == (pytest.approx(table1["total_hours"]),) * 2
    assert "range" in (PROJECT_ROOT / "results" / "tables" / "bspf_coco.cost.md").read_text()
