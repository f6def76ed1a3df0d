"""Throughput, side by side and interleaved, and Lightning's per-step overhead.

Its reasoning: docs/measurements.md, "vitexp/measure/throughput.py".
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from vitexp.models.compiled import CompileOptions

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


def _timer(model: Callable[[torch.Tensor], Any], x: torch.Tensor, amp: bool):
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
    compiled: CompileOptions | None = None,
) -> dict[str, dict[str, Any]]:
    """Time each model on the same input in interleaved rounds; report the median images/s.
    ``batch_size`` / ``amp`` None: the device's protocol (:func:`throughput_protocol`).
    ``compiled`` (enabled): each model is also timed compiled (:func:`vitexp.models.compiled.compile_call`),
    in the same rounds, eager and compiled interleaved; its entry adds ``compiled_throughput`` (and
    its min and max), ``compiled_ratio`` (compiled over eager) and ``compile_s`` (the first compiled
    call, compilation included, after the eager warm-up)."""
    from tqdm.auto import tqdm

    from vitexp.ledger import machine_load

    load = machine_load()  # before the timing: the load the timing ran under (vitexp.ledger.marks.busy)
    was_training = {k: m.training for k, m in models.items()}
    for m in models.values():
        m.eval()
    device = _device_of(next(iter(models.values())))
    batch_size, amp = throughput_protocol(device, batch_size, amp)
    x = torch.randn(batch_size, in_chans, img_size, img_size, device=device)
    calls: dict[str, Callable[[torch.Tensor], Any]] = dict(models)
    compile_s = {}
    if compiled is not None and compiled.enabled:
        calls.update(_compiled_calls(models, x, amp, compiled, compile_s))
    timers = {name: _timer(m, x, amp) for name, m in calls.items()}
    for t in timers.values():
        t.timeit(max(1, warmup))
    samples: dict[str, list[float]] = {k: [] for k in calls}
    bar = tqdm(
        total=rounds * len(calls), desc="throughput", unit="model", disable=not progress or None, leave=False
    )
    for _ in range(rounds):
        for name, t in timers.items():
            samples[name].append(batch_size / t.timeit(iters).mean)
            bar.update()
    bar.close()
    for k, m in models.items():
        m.train(was_training[k])
    out = {
        name: _entry(samples[name], batch_size, img_size, rounds, iters, warmup, device, amp, load)
        for name in models
    }
    for name in compile_s:
        c = samples[name + COMPILED]
        out[name].update(
            compiled_throughput=statistics.median(c),
            compiled_throughput_min=min(c),
            compiled_throughput_max=max(c),
            compiled_ratio=statistics.median(c) / out[name]["throughput"],
            compile_s=compile_s[name],
            compile=compiled.record(),
        )
    return out


#: The key of a model's compiled call among :func:`compare_throughput`'s timers.
COMPILED = ":compiled"


def _compiled_calls(
    models: Mapping[str, nn.Module], x: torch.Tensor, amp: bool, options: CompileOptions, seconds: dict
) -> dict[str, Callable[[torch.Tensor], Any]]:
    """{name + :data:`COMPILED`: the model compiled}, each compiled by a first call timed into
    ``seconds`` (dynamo's cache limit raised to hold every model: they share timm's code objects)."""
    from vitexp.models.compiled import compile_call

    out = {}
    limit = max(int(torch._dynamo.config.recompile_limit), 2 * len(models) + 2)
    with torch._dynamo.config.patch(recompile_limit=limit):
        for name, m in models.items():
            call = compile_call(m, options)
            _sync(x.device)
            start = time.perf_counter()
            with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
                call(x)
            _sync(x.device)
            seconds[name] = time.perf_counter() - start
            out[name + COMPILED] = call
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _facts(batch_size, img_size, rounds, iters, warmup, device, amp) -> dict[str, Any]:
    """What a timing ran: batch, resolution, rounds, device and precision."""
    return {
        "batch_size": batch_size,
        "img_size": img_size,
        "rounds": rounds,
        "iters": iters,
        "warmup": warmup,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": "bf16 autocast" if amp else "fp32",
    }


def _entry(s, batch_size, img_size, rounds, iters, warmup, device, amp, load) -> dict[str, Any]:
    """One model's result of :func:`compare_throughput` from its rounds' images/s ``s``."""
    return {
        "throughput": statistics.median(s),
        "throughput_min": min(s),
        "throughput_max": max(s),
        **_facts(batch_size, img_size, rounds, iters, warmup, device, amp),
        "threads": torch.get_num_threads(),
        "timer": "torch.utils.benchmark.Timer.timeit, median over rounds",
        "load": load,
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
        **_facts(batch_size, img_size, rounds, iters, warmup, device, amp),
        "optimizer": "AdamW",
        "timer": "time.perf_counter over iters steps, median over rounds",
        "load": load,
    }
