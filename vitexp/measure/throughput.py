"""Throughput, side by side and interleaved, and Lightning's per-step overhead.

Its reasoning: docs/measurements.md, "vitexp/measure/throughput.py".
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Mapping

import torch
import torch.nn as nn

#: (batch size, bf16 autocast) by device type when the config leaves them null.
PROTOCOL = {"cuda": (256, True), "cpu": (64, False)}


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def bench_device(name: str) -> torch.device:
    """``bench.device``: ``auto`` is the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"bench.device={name!r}: valid devices are ('auto', 'cpu', 'cuda')")
    return torch.device(name)


def throughput_protocol(
    device: torch.device, batch_size: int | None = None, amp: bool | None = None
) -> tuple[int, bool]:
    """(batch size, bf16 autocast) on ``device``: the given values, else :data:`PROTOCOL`'s."""
    default_batch, default_amp = PROTOCOL["cuda" if device.type == "cuda" else "cpu"]
    return int(batch_size or default_batch), default_amp if amp is None else bool(amp)


def _timer(model: nn.Module, x: torch.Tensor, amp: bool):
    from torch.utils import benchmark

    def forward() -> None:
        with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
            model(x)

    return benchmark.Timer(
        stmt="forward()", globals={"forward": forward}, num_threads=torch.get_num_threads()
    )


def measure_throughput(
    model: nn.Module,
    batch_size: int | None = None,
    img_size: int = 224,
    warmup: int = 2,
    iters: int = 10,
    in_chans: int = 3,
    amp: bool | None = None,
) -> dict[str, Any]:
    """Images per second of ``model`` (eval mode, no grad, random input, on the model's device)
    after ``warmup`` discarded passes."""
    return compare_throughput(
        {"model": model},
        batch_size,
        img_size,
        warmup=warmup,
        rounds=1,
        iters=iters,
        in_chans=in_chans,
        amp=amp,
    )["model"]


def compare_throughput(
    models: Mapping[str, nn.Module],
    batch_size: int | None,
    img_size: int,
    warmup: int = 2,
    rounds: int = 5,
    iters: int = 5,
    in_chans: int = 3,
    amp: bool | None = None,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """Time each model on the same input in interleaved rounds; report the median images/s.
    ``batch_size`` / ``amp`` None: the device's protocol (:func:`throughput_protocol`)."""
    from tqdm.auto import tqdm

    from vitexp.ledger import machine_load

    load = machine_load()  # before the timing: the load the timing ran under (vitexp.ledger.marks.busy)
    was_training = {k: m.training for k, m in models.items()}
    for m in models.values():
        m.eval()
    device = _device_of(next(iter(models.values())))
    batch_size, amp = throughput_protocol(device, batch_size, amp)
    x = torch.randn(batch_size, in_chans, img_size, img_size, device=device)
    timers = {name: _timer(m, x, amp) for name, m in models.items()}
    for t in timers.values():
        t.timeit(max(1, warmup))
    samples: dict[str, list[float]] = {k: [] for k in models}
    bar = tqdm(
        total=rounds * len(models), desc="throughput", unit="model", disable=not progress or None, leave=False
    )
    for _ in range(rounds):
        for name, t in timers.items():
            samples[name].append(batch_size / t.timeit(iters).mean)
            bar.update()
    bar.close()
    for k, m in models.items():
        m.train(was_training[k])
    return {
        name: {
            "throughput": statistics.median(s),
            "throughput_min": min(s),
            "throughput_max": max(s),
            "batch_size": batch_size,
            "img_size": img_size,
            "rounds": rounds,
            "iters": iters,
            "warmup": warmup,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": "bf16 autocast" if amp else "fp32",
            "threads": torch.get_num_threads(),
            "timer": "torch.utils.benchmark.Timer.timeit, median over rounds",
            "load": load,
        }
        for name, s in samples.items()
    }


def measure_train_step(
    model: nn.Module,
    num_classes: int,
    batch_size: int,
    img_size: int,
    amp: bool = False,
    warmup: int = 2,
    iters: int = 5,
    rounds: int = 3,
) -> dict[str, Any]:
    """Training images per second of ``model`` on its device: ``rounds`` timings of ``iters`` steps
    (forward under bf16 autocast when ``amp``, cross-entropy on random labels, backward, AdamW step)
    on one random batch after ``warmup`` steps; the median round (CUDA synchronised at both ends)."""
    from vitexp.ledger import machine_load

    load = machine_load()
    device = _device_of(model)
    model.train()
    x = torch.randn(batch_size, 3, img_size, img_size, device=device)
    y = torch.randint(0, num_classes, (batch_size,), device=device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(max(1, warmup)):
        step()
    rates = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        sync()
        rates.append(batch_size * iters / (time.perf_counter() - start))
    return {
        "train_images_per_s": statistics.median(rates),
        "train_images_per_s_min": min(rates),
        "train_images_per_s_max": max(rates),
        "batch_size": batch_size,
        "img_size": img_size,
        "rounds": rounds,
        "iters": iters,
        "warmup": warmup,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": "bf16 autocast" if amp else "fp32",
        "optimizer": "AdamW",
        "timer": "time.perf_counter over iters steps, median over rounds",
        "load": load,
    }
