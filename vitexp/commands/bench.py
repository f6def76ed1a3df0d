"""The body of ``vitexp-bench``, one function per ``bench.mode`` (:func:`run_bench`), and
``bench.compare`` (:func:`run_compare`): several experiments' deployed models timed in one
interleaved run. Each runs inside :func:`vitexp.runs.owner.owned_run`, which owns its ledger entry, logger
and closing JSON line; the measurements themselves are :mod:`vitexp.measure.throughput`'s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, open_dict

from vitexp import CONF_DIR
from vitexp.config.composition import to_container
from vitexp.errors import ConfigError, one_line
from vitexp.ledger import portable_path, portable_text
from vitexp.ledger.entry import cpu_model
from vitexp.runs.owner import owned_run
from vitexp.training.resolve import Resolved, resolve

#: ``bench.mode`` choices.
BENCH_MODES = ("throughput", "overhead", "loader", "train_step", "demo")


def run_bench(cfg: DictConfig) -> dict[str, Any]:
    """``bench.mode=throughput``: the method's deployed model against its unmodified backbone,
    interleaved, images/s and their ratio beside the GMACs ratio. ``bench.mode=overhead``:
    Lightning's per-step overhead against a plain PyTorch loop on the same model and batches.
    ``bench.mode=loader``: the row's training (or evaluation) loader, images/s per worker for each
    decoder (:mod:`vitexp.data.loader_bench`). ``bench.mode=train_step``: training images/s of the
    configured model on its device (:func:`vitexp.measure.throughput.measure_train_step`).
    ``bench.mode=demo``:
    the first command a newcomer runs, ``vitexp-train``, timed as they run it (:func:`_run_demo`)."""
    if cfg.bench.mode == "throughput" and cfg.bench.get("compare"):
        from vitexp.runs.owner import emit

        result = run_compare(cfg)
        emit(result)
        return result
    if cfg.bench.mode not in BENCH_MODES:
        raise ConfigError(f"bench.mode: {cfg.bench.mode!r} is not one of {BENCH_MODES}")
    resolved = resolve(cfg, need_data=cfg.bench.mode == "overhead", need_trainer=False)
    if cfg.bench.mode in ("throughput", "overhead", "train_step"):
        resolved.objective.check_timed(cfg)
    if cfg.bench.mode == "overhead" and resolved.method.objective != "classify":
        raise ConfigError(
            f"bench.mode=overhead times the classify objective; method {resolved.method.name} is"
            f" {resolved.method.objective}"
        )
    if cfg.bench.mode == "loader":
        _check_loader(cfg)
    with owned_run(cfg.name, "bench", cfg.results_dir, cfg.output_dir, cfg.logger) as run:
        if cfg.bench.mode == "loader":
            _run_loader(resolved, run)
        elif cfg.bench.mode == "train_step":
            _run_train_step(resolved, run)
        elif cfg.bench.mode == "demo":
            _run_demo(cfg, run)
        else:
            _run_model_timing(resolved, run)
    return run.result


def _run_model_timing(resolved: Resolved, run) -> None:
    """``bench.mode=throughput`` (one experiment) and ``overhead`` (:func:`run_bench`)."""
    from vitexp.measure.flops import count_macs
    from vitexp.measure.throughput import bench_device, compare_throughput
    from vitexp.training.build import build_configured_backbone, build_datamodule, build_model
    from vitexp.training.overhead import lightning_overhead

    cfg = resolved.cfg
    run.start(to_container(cfg))

    img = int(cfg.backbone.img_size)
    b = cfg.bench
    model, method, data_config = build_model(cfg, resolved.method, resolved.weights)
    if b.mode == "throughput":
        deployed = method.deploy(model)
        baseline = build_configured_backbone(cfg, resolved.weights)
        macs_m, macs_b = count_macs(deployed, img).gmacs, count_macs(baseline, img).gmacs
        device = bench_device(str(b.device))
        res = compare_throughput(
            {"method": deployed.to(device), "baseline": baseline.to(device)},
            b.batch_size,
            img,
            warmup=int(b.warmup),
            rounds=int(b.rounds),
            iters=int(b.iters),
            amp=b.amp,
            progress=True,
            compiled=_compile_options(cfg),
        )
        metrics = {
            "throughput": res["method"]["throughput"],
            "baseline_throughput": res["baseline"]["throughput"],
            "throughput_ratio": res["method"]["throughput"] / res["baseline"]["throughput"],
            "gmacs": macs_m,
            "baseline_gmacs": macs_b,
            "gmacs_ratio": macs_b / macs_m,
            **compiled_metrics(res["method"], res["baseline"]),
        }
        protocol = {"mode": "throughput", "interleaved": True, **_timing_protocol(res["method"])}
        print(
            f"{cfg.name}: {metrics['throughput']:.1f} vs baseline {metrics['baseline_throughput']:.1f}"
            f" images/s (ratio {metrics['throughput_ratio']:.2f}; GMACs ratio {metrics['gmacs_ratio']:.2f}),"
            f" batch {protocol['batch_size']}, {img} px, {protocol['device_name']}, {protocol['precision']},"
            f" {torch.get_num_threads()} threads" + _compiled_line(metrics, "baseline")
        )
    else:
        import copy

        datamodule = build_datamodule(cfg, data_config)
        datamodule.setup("fit")
        state = copy.deepcopy(model.state_dict())

        def make_model():
            m = copy.deepcopy(model)
            m.load_state_dict(state)
            return m

        metrics = lightning_overhead(
            make_model,
            datamodule.train_dataloader,
            int(cfg.data.num_classes),
            dict(cfg.recipe),
            steps=int(b.steps),
            warmup=int(b.warmup) + 3,
        )
        protocol = {
            "mode": "overhead",
            "batch_size": int(cfg.recipe.batch_size),
            "img_size": img,
            "device": "cpu",
            "threads": torch.get_num_threads(),
            "statistic": "median seconds between consecutive batch starts, best of 2 alternations",
        }
        print(
            f"{cfg.name}: plain loop {metrics['plain_step_s'] * 1e3:.2f} ms/step, Lightning"
            f" {metrics['lightning_step_s'] * 1e3:.2f} ms/step: overhead"
            f" {100 * metrics['lightning_overhead']:+.1f} %"
        )
    run.complete(metrics, protocol)


def _compile_options(cfg: DictConfig):
    """The ``compile`` block as :func:`vitexp.measure.throughput.compare_throughput` takes it: enabled,
    each model is timed eager and compiled, interleaved."""
    from vitexp.models.compiled import CompileOptions

    return CompileOptions.of(cfg.get("compile"))


#: A timing's keys that are metrics, not protocol (:func:`compiled_metrics`).
_MEASURED = (
    "throughput",
    "compiled_throughput",
    "compiled_throughput_min",
    "compiled_throughput_max",
    "compiled_ratio",
    "compile_s",
)


def _timing_protocol(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k not in _MEASURED}


def compiled_metrics(res: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """The metrics of a timing with ``compile`` enabled: the model's compiled images/s, its compiled
    over eager ratio and the seconds of its first compiled call (``compile_s``), the reference's
    (``baseline_*``), and the speedup over the reference under compile (``compiled_throughput_ratio``);
    ``{}`` when the timing was eager only."""
    if "compiled_throughput" not in res:
        return {}
    return {
        "compiled_throughput": res["compiled_throughput"],
        "compiled_ratio": res["compiled_ratio"],
        "compile_s": res["compile_s"],
        "baseline_compiled_throughput": ref["compiled_throughput"],
        "baseline_compiled_ratio": ref["compiled_ratio"],
        "baseline_compile_s": ref["compile_s"],
        "compiled_throughput_ratio": res["compiled_throughput"] / ref["compiled_throughput"],
    }


def _compiled_line(metrics: dict[str, Any], ref: str) -> str:
    if "compiled_throughput" not in metrics:
        return ""
    return (
        f"; compiled {metrics['compiled_throughput']:.1f} images/s ({metrics['compiled_ratio']:.2f} x eager,"
        f" first call {metrics['compile_s']:.1f} s), speedup over {ref} under compile"
        f" {metrics['compiled_throughput_ratio']:.2f}"
    )


def _loader_datamodule(cfg: DictConfig, data_config: dict[str, Any], root: str, decoder: str):
    from vitexp.training.build import build_datamodule

    data = cfg.copy()
    with open_dict(data):
        data.data.root, data.data.decoder = root, decoder
        data.data.num_workers = int(cfg.bench.loader.workers)
    datamodule = build_datamodule(data, data_config)
    datamodule.setup("fit")
    return datamodule


def _check_loader(cfg: DictConfig) -> None:
    """``bench.mode=loader``'s own keys, checked with the config at the command's top."""
    from vitexp.data.tensor_images import DECODERS

    lo = cfg.bench.loader
    if "decoder" not in cfg.data:
        raise ConfigError(
            "bench.mode=loader times an image-folder loader (data=imagenet or imagefolder); "
            f"data={cfg.data.name} has no decoder"
        )
    unknown = sorted(set(lo.decoders) - set(DECODERS))
    if unknown or lo.split not in ("train", "eval") or int(lo.workers) < 1 or int(lo.batches) < 1:
        raise ConfigError(
            f"bench.loader: decoders {list(lo.decoders)} must be among {DECODERS}, split "
            f"{lo.split!r} train or eval, workers ({lo.workers}) and batches ({lo.batches}) >= 1"
        )


def _run_loader(resolved: Resolved, run) -> None:
    """``bench.mode=loader`` (:mod:`vitexp.data.loader_bench`): the row's loader over ImageNet-like JPEGs
    (:mod:`vitexp.data.imagenet_like`, generated once into a cache folder unless ``bench.loader.root``
    names a folder), each decoder's images/s per worker; one ledger entry."""

    from vitexp.data.imagenet_like import JpegSpec, ensure_jpegs
    from vitexp.data.loader_bench import STATISTIC, compare_loaders, winner
    from vitexp.training.build import build_configured_backbone, data_config_for

    cfg = resolved.cfg
    b, lo = cfg.bench, cfg.bench.loader
    run.start(to_container(cfg))
    if lo.root:
        jpegs = {"root": str(lo.root), "spec": "a given folder"}
    else:
        spec = JpegSpec(
            classes=int(cfg.data.num_classes),
            train_per_class=int(lo.train_per_class),
            val_per_class=int(lo.val_per_class),
        )
        jpegs = ensure_jpegs(spec, progress=True)
    data_config = data_config_for(cfg, build_configured_backbone(cfg, resolved.weights))
    modules = {d: _loader_datamodule(cfg, data_config, jpegs["root"], d) for d in lo.decoders}
    train = lo.split == "train"
    loaders = {d: m.train_dataloader() if train else m.val_dataloader() for d, m in modules.items()}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_batch = {
        d: (lambda x, m=m: m.device_normalize(x, train=train)) if m.device_normalize is not None else None
        for d, m in modules.items()
    }
    res = compare_loaders(loaders, int(lo.batches), int(b.rounds), int(lo.workers), on_batch, device)
    metrics = {f"{d}_images_per_s_per_worker": r["images_per_s_per_worker"] for d, r in res.items()}
    metrics.update(
        {
            f"{d}_{k}": r[k]
            for d, r in res.items()
            for k in ("min", "max", "wall_images_per_s_per_worker", "main_ms_per_image")
        }
    )
    metrics["winner"] = winner(res)
    import platform

    protocol = {
        "mode": "loader",
        "split": lo.split,
        "decoders": list(lo.decoders),
        "workers": int(lo.workers),
        "batch_size": int(cfg.data.batch_size),
        "batches": int(lo.batches),
        "rounds": int(b.rounds),
        "img_size": int(data_config["input_size"][-1]),
        "interpolation": data_config.get("interpolation"),
        "crop_pct": data_config.get("crop_pct"),
        "auto_augment": cfg.data.auto_augment if train else None,
        "random_erase": float(cfg.data.random_erase or 0.0) if train else 0.0,
        "transforms": {d: str(loaders[d].dataset.transform) for d in loaders},
        "jpegs": {k: v for k, v in jpegs.items() if k != "root"},
        "cpu": cpu_model() or platform.machine(),
        "statistic": STATISTIC,
        "rounds_per_decoder": {d: r["rounds"] for d, r in res.items()},
        "load": next(iter(res.values()))["load"],
        "device_side": str(device),
    }
    print(
        f"{cfg.name}: loader ({lo.split} transform, {protocol['img_size']} px, batch"
        f" {protocol['batch_size']}, {lo.workers} worker(s)): "
        + "; ".join(
            f"{d} {r['images_per_s_per_worker']:.1f} images/s per worker (rounds"
            f" {r['min']:.1f}-{r['max']:.1f}; wall {r['wall_images_per_s_per_worker']:.1f})"
            for d, r in res.items()
        )
        + f"; faster beyond the spread: {metrics['winner'] or 'neither'}"
    )
    run.complete(metrics, protocol)


def _run_train_step(resolved: Resolved, run) -> None:
    """``bench.mode=train_step``: the configured model's training images/s on ``bench.device`` (a
    plain loop: forward, cross-entropy, backward, optimiser step, synthetic batch; bf16 autocast on a
    GPU), the rate :mod:`vitexp.cost` takes for that GPU in place of its factor (docs/cluster.md)."""

    from vitexp.measure.throughput import bench_device, measure_train_step, throughput_protocol
    from vitexp.training.build import build_model

    cfg = resolved.cfg
    run.start(to_container(cfg))
    model, method, _ = build_model(cfg, resolved.method, resolved.weights)
    device = bench_device(str(cfg.bench.device))
    batch, amp = throughput_protocol(device, cfg.bench.batch_size, cfg.bench.amp)
    res = measure_train_step(
        model.to(device),
        int(cfg.data.num_classes),
        batch,
        int(cfg.backbone.img_size),
        amp=amp,
        warmup=int(cfg.bench.warmup),
        iters=int(cfg.bench.iters),
        rounds=int(cfg.bench.rounds),
    )
    metrics = {"train_images_per_s": res.pop("train_images_per_s")}
    print(
        f"{cfg.name}: {metrics['train_images_per_s']:.1f} training images/s on {res['device_name']} "
        f"(batch {batch}, {res['precision']}, {int(cfg.backbone.img_size)} px)"
    )
    run.complete(metrics, {"mode": "train_step", **res, "threads": torch.get_num_threads()})


def _run_demo(cfg: DictConfig, run) -> None:
    """``bench.mode=demo``: ``vitexp-train`` with no arguments (the digits demo; ``bench.demo_args``
    appends overrides, e.g. a shorter recipe) in a fresh process,
    its results in a scratch folder that is then removed, as a newcomer runs it. Two numbers: the
    demo's ``fit_time_s`` (its own closing line) and the rest of the command's wall clock
    (interpreter start, imports, composition, building, test, FLOPs count, throughput timing,
    ledger writes), with the machine's load before and after; its top-1 beside them, so a faster
    demo that learns less shows."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from vitexp.ledger import Ledger, machine_load

    run.start(to_container(cfg))
    scratch = Path(tempfile.mkdtemp(prefix="vitexp-demo-bench-"))
    try:
        env = {**os.environ, "VITEXP_RESULTS": str(scratch / "results")}
        extra = [str(a) for a in cfg.bench.get("demo_args") or []]
        command = [
            sys.executable,
            "-m",
            "vitexp.commands.cli",
            "train",
            *extra,
            f"hydra.run.dir={scratch / 'outputs'}",
        ]
        load_before = machine_load()
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        load_after = machine_load()
        lines = done.stdout.strip().splitlines()
        closing = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        if done.returncode != 0 or closing.get("status") != "completed":
            raise RuntimeError(
                f"the demo did not complete (exit {done.returncode}): "
                + (one_line(RuntimeError(done.stderr.strip()[-400:])) or "no output")
            )
        demo = closing["metrics"]
        child = next(iter(Ledger.load(scratch / "results")), {})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    fit = float(demo["fit_time_s"])
    # the demo's own metrics under demo_* names: this entry shares the demo's config, and a table cell
    # that reads the demo's ``top1`` must never take it from a timing
    metrics = {
        "demo_wall_s": wall,
        "demo_fit_s": fit,
        "demo_overhead_s": wall - fit,
        "demo_top1": float(demo["top1"]),
        "demo_epochs": int(demo["epochs"]),
        "demo_steps": int(demo["steps"]),
    }
    protocol = {
        "mode": "demo",
        "command": " ".join(["vitexp-train", *extra]) + " (results in a scratch folder)",
        "wall": "process start to exit",
        "overhead": "wall - fit_time_s",
        "load_before": load_before,
        "load_after": load_after,
        "demo_threads": ((child.get("env") or {}).get("load") or {}).get("threads"),
        "cpu": cpu_model(),
        "demo_commit": (child.get("env") or {}).get("git_commit"),
    }
    print(
        f"{cfg.name}: vitexp-train took {wall:.1f} s: fit {fit:.1f} s, the rest {wall - fit:.1f} s "
        f"(top-1 {metrics['demo_top1']:.2f}; load {load_before['loadavg']} -> {load_after['loadavg']} on "
        f"{load_before['cpus']} CPUs)"
    )
    run.complete(metrics, protocol)


def _compose_experiment(name: str) -> DictConfig:
    """The config of experiment ``name`` (``conf/experiment/<name>.yaml``), else of the table row
    recorded under ``name`` (a base experiment and overrides, :mod:`vitexp.config.rows`: EViT's keep rates
    and ToMe's r are rows of the DeiT-S specs), composed beside the running Hydra app (or standalone)."""
    from hydra import compose as hydra_compose
    from hydra.core.global_hydra import GlobalHydra

    overrides = (
        [f"experiment={name}"] if (CONF_DIR / "experiment" / f"{name}.yaml").is_file() else _row_job(name)
    )
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="train", overrides=overrides)
    from vitexp.config.composition import compose

    return compose(overrides)


def _row_job(name: str) -> list[str]:
    """The job of the table row recorded under ``name`` (unseeded, no weights: a timing needs none)."""
    from vitexp.config.rows import job_arguments
    from vitexp.report.tables import row_by_name

    row = row_by_name(name)
    if row is not None:
        return job_arguments(row, seeded=False, weights=False)
    raise ConfigError(
        f"bench.compare: {name!r} is neither an experiment (conf/experiment/{name}.yaml) nor the "
        "name of a table row (sweeps/*.yaml)"
    )


def run_compare(cfg: DictConfig) -> dict[str, Any]:
    """``bench.compare=[A, B, ...]``: the deployed models of several experiments timed in one
    interleaved run (:func:`vitexp.measure.throughput.compare_throughput`) on ``bench.*``'s device, batch and
    precision. A is the reference: each experiment gets a bench ledger entry with its images/s,
    its speedup over A (``throughput_ratio``) and A's GMACs over its own (``gmacs_ratio``). The
    machine's load average before and after goes into the protocol (a shared CPU shows there).
    Each entry has its own :func:`vitexp.runs.owner.owned_run` (no logger: one W&B run per row would split
    one measurement); one closing JSON line lists them all, also when the timing fails (then each
    entry is marked failed)."""
    import contextlib
    import os

    from vitexp.measure.flops import count_macs
    from vitexp.measure.throughput import bench_device, compare_throughput
    from vitexp.runs.owner import emit
    from vitexp.training.build import build_model

    names = [str(n) for n in cfg.bench.compare]
    if len(names) < 2 or len(set(names)) != len(names):
        raise ConfigError(
            f"bench.compare: {names} must name at least two different experiments (the first is the"
            " reference)"
        )
    subs = {}
    for name in names:
        sub = _compose_experiment(name)
        with open_dict(sub):
            sub.output_dir, sub.results_dir, sub.bench, sub.logger, sub.compile = (
                cfg.output_dir,
                cfg.results_dir,
                cfg.bench,
                cfg.logger,
                cfg.compile,
            )
        subs[name] = resolve(sub, need_data=False)
        subs[name].objective.check_timed(sub)
    sizes = {int(sub.cfg.backbone.img_size) for sub in subs.values()}
    if len(sizes) != 1:
        raise ConfigError(f"bench.compare: the experiments run at different resolutions {sorted(sizes)}")
    img = sizes.pop()
    runs: dict[str, Any] = {}  # the owners entered so far: a failure names the entries they started
    try:
        with contextlib.ExitStack() as stack:  # one owner per experiment's entry, one closing line for all
            for name in names:
                runs[name] = stack.enter_context(
                    owned_run(name, "bench", cfg.results_dir, None, None, emits=False)
                )
                runs[name].start(to_container(subs[name].cfg))
            b = cfg.bench
            device = bench_device(str(b.device))
            models, gmacs = {}, {}
            for name, sub in subs.items():
                model, method, _ = build_model(sub.cfg, sub.method, sub.weights)
                deployed = method.deploy(model)
                gmacs[name] = count_macs(deployed, img).gmacs
                models[name] = deployed.to(device)
            load_before = os.getloadavg()
            res = compare_throughput(
                models,
                b.batch_size,
                img,
                warmup=int(b.warmup),
                rounds=int(b.rounds),
                iters=int(b.iters),
                amp=b.amp,
                progress=True,
                compiled=_compile_options(cfg),
            )
            load_after = os.getloadavg()
            ref = names[0]
            for name in names:
                metrics = {
                    "throughput": res[name]["throughput"],
                    "baseline_throughput": res[ref]["throughput"],
                    "throughput_ratio": res[name]["throughput"] / res[ref]["throughput"],
                    "gmacs": gmacs[name],
                    "baseline_gmacs": gmacs[ref],
                    "gmacs_ratio": gmacs[ref] / gmacs[name],
                    **compiled_metrics(res[name], res[ref]),
                }
                protocol = {
                    "mode": "compare",
                    "interleaved": True,
                    "interleaved_with": names,
                    "reference": ref,
                    **_timing_protocol(res[name]),
                    "statistic": "median over rounds",
                    "load_average_1m_before_after": [load_before[0], load_after[0]],
                    "cpu_count": os.cpu_count(),
                }
                print(
                    f"{name}: {metrics['throughput']:.1f} images/s, speedup {metrics['throughput_ratio']:.2f}"
                    f" over {ref} (GMACs ratio {metrics['gmacs_ratio']:.2f}, {gmacs[name]:.3f} GMACs)"
                    + _compiled_line(metrics, ref)
                )
                runs[name].complete(metrics, protocol)
            print(
                f"batch {res[ref]['batch_size']}, {img} px, {res[ref]['device_name']},"
                f" {res[ref]['precision']}, {res[ref]['threads']} threads, load average {load_before[0]:.1f}"
                f" -> {load_after[0]:.1f} on {os.cpu_count()} CPUs"
            )
    except Exception as err:  # each owner marked its entry failed; one closing line names them
        started = [r for r in runs.values() if r.ledger is not None]
        emit(
            {
                "status": "failed",
                "error": portable_text(f"{type(err).__name__}: {one_line(err)}", cfg.results_dir),
                "ledger": [portable_path(r.ledger.path, cfg.results_dir) for r in started],
                "run_id": [r.ledger.run_id for r in started],
            }
        )
        err.vitexp_reported = True
        raise
    return {
        "metrics": {n: r.result["metrics"] for n, r in runs.items()},
        "ledger": [r.result["ledger"] for r in runs.values()],
        "run_id": [r.result["run_id"] for r in runs.values()],
        "status": "completed",
    }
