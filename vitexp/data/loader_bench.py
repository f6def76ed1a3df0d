"""How fast a row's data loader prepares images: images per second per worker, for each decoder (``vitexp-
bench bench.mode=loader``; :mod:`vitexp.cost` divides a row's images by it).

Its reasoning: docs/measurements.md, "vitexp/data/loader_bench.py".
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import torch

#: What each decoder's rate is, in words (the ledger's protocol).
STATISTIC = (
    "images per CPU-second of the loader's workers (worker CPU clock stamped on each batch, "
    "the first batch of each worker excluded), median over interleaved rounds"
)


class _Stamped:
    """A ``collate_fn`` whose batch is ``(batch, (worker id, worker CPU seconds, images))``."""

    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, samples):
        batch = self.collate(samples)
        info = torch.utils.data.get_worker_info()
        return batch, (info.id if info is not None else -1, time.process_time(), len(samples))


def stamp(loader) -> Any:
    """``loader`` with its batches stamped (:class:`_Stamped`); returns the loader."""
    if not isinstance(loader.collate_fn, _Stamped):
        loader.collate_fn = _Stamped(loader.collate_fn)
    return loader


def cpu_rate(stamps: list[tuple[int, float, int]]) -> tuple[float, float, int]:
    """(images, worker CPU seconds, workers seen) from the stamps of one round: per worker, its
    batches after its first and the CPU time between its first and last stamp."""
    by_worker: dict[int, list[tuple[float, int]]] = {}
    for worker, cpu, n in stamps:
        by_worker.setdefault(worker, []).append((cpu, n))
    images, seconds = 0, 0.0
    for seen in by_worker.values():
        if len(seen) > 1:
            images += sum(n for _, n in seen[1:])
            seconds += seen[-1][0] - seen[0][0]
    return images, seconds, len(by_worker)


def time_round(
    loader,
    batches: int,
    workers: int,
    on_batch: Callable[[torch.Tensor], Any] | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """One round: ``batches`` batches after each worker's first (``loader`` stamped); the images per
    worker-CPU-second, per wall-second per worker, and the main process's CPU ms per image in
    ``on_batch`` (the device-side step), which receives each batch's images on ``device``."""
    it = iter(loader)
    stamps, main_cpu, wall_images = [], 0.0, 0
    wall_start = None
    for i in range(batches + max(1, workers)):
        try:
            (x, _), mark = next(it)
        except StopIteration:
            break
        stamps.append(mark)
        if i == max(1, workers) - 1:
            wall_start = time.perf_counter()  # every worker has delivered its first batch
        elif wall_start is not None:
            wall_images += mark[2]
        if on_batch is not None:
            t = time.process_time()
            on_batch(x.to(device) if device is not None else x)
            main_cpu += time.process_time() - t
    wall = time.perf_counter() - wall_start if wall_start is not None else 0.0
    images, seconds, seen = cpu_rate(stamps)
    del it
    return {
        "per_worker_cpu": images / seconds if seconds > 0 else 0.0,
        "per_worker_wall": wall_images / wall / max(1, workers) if wall > 0 else 0.0,
        "images": images,
        "worker_cpu_s": seconds,
        "workers_seen": seen,
        "main_ms_per_image": 1e3 * main_cpu / max(1, sum(m[2] for m in stamps)),
    }


def compare_loaders(
    loaders: Mapping[str, Any],
    batches: int,
    rounds: int,
    workers: int,
    on_batch: Mapping[str, Callable | None] | None = None,
    device: torch.device | None = None,
) -> dict[str, dict[str, Any]]:
    """Each decoder's loader timed in interleaved rounds (module docstring):
    {decoder: {images_per_s_per_worker (median), min, max, rounds: [...], wall_..., main_ms_per_image}}."""
    from vitexp.ledger import machine_load

    load = machine_load()
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in loaders}
    for loader in loaders.values():
        stamp(loader)
    for _ in range(rounds):
        for name, loader in loaders.items():
            samples[name].append(time_round(loader, batches, workers, (on_batch or {}).get(name), device))
    out = {}
    for name, s in samples.items():
        cpu = [r["per_worker_cpu"] for r in s]
        wall = [r["per_worker_wall"] for r in s]
        out[name] = {
            "images_per_s_per_worker": statistics.median(cpu),
            "min": min(cpu),
            "max": max(cpu),
            "rounds": cpu,
            "wall_images_per_s_per_worker": statistics.median(wall),
            "wall_min": min(wall),
            "wall_max": max(wall),
            "main_ms_per_image": statistics.median(r["main_ms_per_image"] for r in s),
            "images_per_round": statistics.median(r["images"] for r in s),
            "load": load,
        }
    return out


def winner(results: Mapping[str, Mapping[str, float]]) -> str | None:
    """The decoder whose slowest round is faster than every other decoder's fastest round (its margin
    exceeds the spread of repeated runs), else ``None``."""
    for name, r in results.items():
        if all(r["min"] > other["max"] for o, other in results.items() if o != name):
            return name
    return None
