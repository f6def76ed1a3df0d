"""The cost model against published training wall clocks (``conf/cost.yaml`` ``validation``).

Its reasoning: docs/cluster.md, "vitexp/cost/validation.py".
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from vitexp.cost.anchors import Anchor, cost_config, gpu_factors, seconds_per_image
from vitexp.cost.loader import loader_runs, rate_for

#: How far apart the model and a publication may be.
FACTOR = 1.5


def _rate(entry: Mapping[str, Any], runs: Iterable[Mapping[str, Any]]):
    t = entry.get("transform")
    if not t:
        return None
    config = {
        "backbone": {"img_size": t["img_size"]},
        "data": {
            "decoder": t["decoder"],
            "auto_augment": t["auto_augment"],
            "random_erase": t["random_erase"],
        },
    }
    return rate_for(config, "train", runs)


def predict(name: str, ledger=None) -> dict[str, Any]:
    """The model's wall clock for validation entry ``name`` and how it compares (module docstring):
    {name, what, hours (model), published, kind, ratio (model / published), holds, gpu_hours, loader_bound,
    loader (the rate used or None), source}."""
    cost = cost_config()
    entry = cost["validation"][name]
    anchor = Anchor.named(entry["anchor"], cost)
    factors = gpu_factors(ledger, cost)
    gpus = int(entry["gpus"])
    train_images = float(entry.get("images") or int(entry["epochs"]) * 1_281_167)
    per_gpu = train_images / gpus
    gpu_train = per_gpu * seconds_per_image(anchor, anchor.train_gflops, entry["gpu"], factors)
    rate = _rate(entry, loader_runs(ledger))
    loader = per_gpu / (int(entry["workers_per_gpu"]) * rate.per_worker) if rate is not None else None
    evaluations = int(entry.get("epochs") or 0) * 50_000
    eval_images = evaluations if entry.get("eval_on_every_gpu") else evaluations / gpus
    evaluation = eval_images * seconds_per_image(
        anchor, anchor.forward_gflops, entry["gpu"], factors, train=False
    )
    hours = (max(gpu_train, loader or 0.0) + evaluation) / 3600
    published = float(entry["hours"])
    ratio = hours / published
    holds = ratio <= FACTOR if entry["kind"] == "upper_bound" else 1 / FACTOR <= ratio <= FACTOR
    return {
        "name": name,
        "what": entry["what"],
        "hours": hours,
        "published": published,
        "kind": entry["kind"],
        "ratio": ratio,
        "holds": holds,
        "gpus": gpus,
        "gpu": entry["gpu"],
        "gpu_hours": hours * gpus,
        "loader_bound": loader is not None and loader > gpu_train,
        "loader": rate,
        "gpu_train_hours": gpu_train / 3600,
        "loader_hours": loader / 3600 if loader is not None else None,
        "eval_hours": evaluation / 3600,
        "source": " ".join(str(entry["source"]).split()),
    }


def validations(ledger=None) -> list[dict[str, Any]]:
    """:func:`predict` for every entry, in ``conf/cost.yaml``'s order."""
    return [predict(name, ledger) for name in cost_config()["validation"]]


def render(results: Iterable[Mapping[str, Any]]) -> str:
    """The checks as a markdown table (docs/cluster.md)."""
    lines = [
        (
            "| published run | published wall clock | model's wall clock (GPU; loader; evaluation) | model /"
            f" published | within {FACTOR} |"
        ),
        "|---|---:|---:|---:|---|",
    ]
    for r in results:
        bound = "less than " if r["kind"] == "upper_bound" else ""
        loader = f"{r['loader_hours']:.1f} h" if r["loader_hours"] is not None else "not measured"
        lines.append(
            f"| {r['what']}, {r['gpus']} × {r['gpu']} | {bound}{r['published']:g} h | {r['hours']:.1f} h "
            f"({r['gpu_train_hours']:.1f} h; {loader}; {r['eval_hours']:.1f} h) | {r['ratio']:.2f} | "
            f"{'yes' if r['holds'] else '**no**'}"
            f"{' (a bound: one-sided)' if r['kind'] == 'upper_bound' else ''} |"
        )
    return "\n".join(lines) + "\n"
