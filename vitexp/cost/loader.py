"""The loader side of a row's cost: how fast its data loader prepares images, and how many workers it gets
on a cluster node.

Its reasoning: docs/cluster.md, "vitexp/cost/loader.py".
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping


@functools.lru_cache(maxsize=1)
def cpus_per_task() -> int:
    """``cpus_per_task`` that vitexp's SLURM launcher asks for a GPU job (one task per GPU:
    :func:`vitexp.runs.slurm.resources`)."""
    from vitexp.runs.slurm import resources

    return int(resources({"accelerator": "gpu", "devices": 1, "strategy": "ddp"})["cpus_per_task"])


def workers(config: Mapping[str, Any], cpus: int, main_cores: int) -> int:
    """Loader workers a row gets per GPU: ``min(data.num_workers, cpus − main_cores)``, at least 1."""
    return max(1, min(int((config.get("data") or {}).get("num_workers") or 0) or cpus, cpus - main_cores))


@dataclass(frozen=True)
class LoaderRate:
    """Images/s per worker of one transform and decoder: the median over the bench runs that measured it
    (``runs``), and the lowest and highest of their medians."""

    per_worker: float
    low: float
    high: float
    decoder: str
    runs: tuple[str, ...]
    cpu: str


def transform_key(config: Mapping[str, Any], split: str) -> tuple | None:
    """What a loader's rate depends on: (split, resolution, RandAugment, random erasing), the last two
    for the training split only; ``None`` for data without a decoder (not an image folder)."""
    data = config.get("data") or {}
    if "decoder" not in data:
        return None
    img = int((config.get("backbone") or {}).get("img_size") or 224)
    if split == "train":
        return ("train", img, data.get("auto_augment") or None, float(data.get("random_erase") or 0.0))
    return ("eval", img, None, 0.0)


def _bench_key(protocol: Mapping[str, Any]) -> tuple:
    train = protocol.get("split") == "train"
    return (
        protocol.get("split"),
        int(protocol.get("img_size") or 0),
        (protocol.get("auto_augment") or None) if train else None,
        float(protocol.get("random_erase") or 0.0) if train else 0.0,
    )


def loader_runs(ledger) -> list[dict[str, Any]]:
    """The completed ``bench.mode=loader`` runs of ``ledger``, oldest first."""
    if ledger is None:
        return []
    return [
        r
        for r in ledger
        if r.get("kind") == "bench"
        and r.get("status") == "completed"
        and (r.get("protocol") or {}).get("mode") == "loader"
    ]


def rate_for(config: Mapping[str, Any], split: str, runs: Iterable[Mapping[str, Any]]) -> LoaderRate | None:
    """The row's rate for ``split`` (module docstring), or ``None`` (not measured)."""
    key = transform_key(config, split)
    if key is None:
        return None
    decoder = str(config["data"]["decoder"])
    found = [
        (run, float((run.get("metrics") or {})[f"{decoder}_images_per_s_per_worker"]))
        for run in runs
        if _bench_key(run.get("protocol") or {}) == key
        and (run.get("metrics") or {}).get(f"{decoder}_images_per_s_per_worker")
    ]
    if not found:
        return None
    rates = [rate for _, rate in found]
    return LoaderRate(
        statistics.median(rates),
        min(rates),
        max(rates),
        decoder,
        tuple(r["run_id"] for r, _ in found),
        str((found[-1][0].get("protocol") or {}).get("cpu") or "?"),
    )


def decoder_verdicts(runs: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """{transform key: {runs: [run ids], medians: {decoder: [per-run median images/s per worker]}, winner}}
    over the loader benches ``runs`` (module docstring); ``winner`` is ``None`` with fewer than two runs."""
    out: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        protocol, metrics = run.get("protocol") or {}, run.get("metrics") or {}
        entry = out.setdefault(_bench_key(protocol), {"runs": [], "medians": {}})
        entry["runs"].append(run["run_id"])
        for d in protocol.get("decoders") or []:
            entry["medians"].setdefault(d, []).append(float(metrics[f"{d}_images_per_s_per_worker"]))
    for entry in out.values():
        m, entry["winner"] = entry["medians"], None
        if len(entry["runs"]) >= 2:
            entry["winner"] = next(
                (d for d, v in m.items() if all(min(v) > max(w) for o, w in m.items() if o != d)), None
            )
    return out
