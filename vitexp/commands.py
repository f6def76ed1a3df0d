"""The bodies of the commands that do not train: ``vitexp-flops``, ``vitexp-bench``,
``vitexp-audit``, ``vitexp-analyze``. Each runs inside :func:`vitexp.run.owned_run`, which owns
its ledger entry, logger and closing JSON line; :mod:`vitexp.cli` parses the command lines."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from vitexp import CONF_DIR
from vitexp.config import to_container, validate
from vitexp.errors import ConfigError, one_line
from vitexp.ledger import atomic_write, portable_path, portable_text
from vitexp.objectives import objective_for
from vitexp.run import owned_run


def run_flops(cfg: DictConfig) -> dict[str, Any]:
    """Params and MACs of the configured model as deployed, without training, as its objective counts
    it (:meth:`vitexp.objectives.Objective.count`); one ledger entry. Seeded by ``cfg.seed`` first: a
    method whose deployed shape depends on an initialisation (SAPER's initial head scores pick the k
    heads) counts the same model every time, and records it (``method.record()``, e.g. ``kept_heads``)."""
    import lightning as L

    from vitexp.build import build_model

    with owned_run(cfg.name, "flops", cfg.results_dir, cfg.output_dir, cfg.logger) as run:
        method = validate(cfg, need_data=False)
        objective = objective_for(cfg)
        run.start(to_container(cfg))
        L.seed_everything(int(cfg.seed), workers=True, verbose=False)
        model, method, data_config = build_model(cfg, method)
        count = objective.count(cfg, objective.measured(cfg, method.deploy(model), data_config))
        metrics, protocol = count.metrics, count.protocol
        print(f"{cfg.name}: {metrics['params_m']:.2f} M params, {metrics['gmacs']:.3f} GMACs "
              f"({metrics['gflops']:.3f} GFLOPs = 2 x MACs) at {count.where}, "
              f"attention matmuls counted; by module (GMACs): "
              + ", ".join(f"{k} {v:.3f}" for k, v in count.parts.items() if v > 0))
        run.complete(metrics, protocol, out={"protocol": protocol}, by_module=count.by_module, **method.record())
    return run.result


def run_bench(cfg: DictConfig) -> dict[str, Any]:
    """``bench.mode=throughput``: the method's deployed model against its unmodified backbone,
    interleaved, images/s and their ratio beside the GMACs ratio. ``bench.mode=overhead``:
    Lightning's per-step overhead against a plain PyTorch loop on the same model and batches."""
    from vitexp.bench import bench_device, compare_throughput, lightning_overhead
    from vitexp.build import build_configured_backbone, build_datamodule, build_model
    from vitexp.flops import count_macs

    if cfg.bench.mode == "throughput" and cfg.bench.get("compare"):
        from vitexp.run import emit

        result = run_compare(cfg)
        emit(result)
        return result
    with owned_run(cfg.name, "bench", cfg.results_dir, cfg.output_dir, cfg.logger) as run:
        if cfg.bench.mode not in ("throughput", "overhead"):
            raise ConfigError(f"bench.mode: {cfg.bench.mode!r} is not one of ('throughput', 'overhead')")
        method = validate(cfg, need_data=cfg.bench.mode == "overhead", need_trainer=False)
        objective_for(cfg).check_timed(cfg)
        run.start(to_container(cfg))
        import torch

        img = int(cfg.backbone.img_size)
        b = cfg.bench
        model, method, data_config = build_model(cfg, method)
        if b.mode == "throughput":
            deployed = method.deploy(model)
            baseline = build_configured_backbone(cfg)
            macs_m, macs_b = count_macs(deployed, img).gmacs, count_macs(baseline, img).gmacs
            device = bench_device(str(b.device))
            res = compare_throughput({"method": deployed.to(device), "baseline": baseline.to(device)}, b.batch_size,
                                     img, warmup=int(b.warmup), rounds=int(b.rounds), iters=int(b.iters), amp=b.amp,
                                     progress=True)
            metrics = {"throughput": res["method"]["throughput"], "baseline_throughput": res["baseline"]["throughput"],
                       "throughput_ratio": res["method"]["throughput"] / res["baseline"]["throughput"],
                       "gmacs": macs_m, "baseline_gmacs": macs_b, "gmacs_ratio": macs_b / macs_m}
            protocol = {"mode": "throughput", "interleaved": True, **res["method"]}
            protocol.pop("throughput", None)
            print(f"{cfg.name}: {metrics['throughput']:.1f} vs baseline {metrics['baseline_throughput']:.1f} images/s "
                  f"(ratio {metrics['throughput_ratio']:.2f}; GMACs ratio {metrics['gmacs_ratio']:.2f}), "
                  f"batch {protocol['batch_size']}, {img} px, {protocol['device_name']}, {protocol['precision']}, "
                  f"{torch.get_num_threads()} threads")
        else:
            if method.objective != "classify":
                raise ConfigError(f"bench.mode=overhead times the classify objective; method {method.name} is {method.objective}")
            import copy

            datamodule = build_datamodule(cfg, data_config)
            datamodule.setup("fit")
            state = copy.deepcopy(model.state_dict())

            def make_model():
                m = copy.deepcopy(model)
                m.load_state_dict(state)
                return m

            metrics = lightning_overhead(make_model, datamodule.train_dataloader, int(cfg.data.num_classes),
                                         dict(cfg.recipe), steps=int(b.steps), warmup=int(b.warmup) + 3)
            protocol = {"mode": "overhead", "batch_size": int(cfg.recipe.batch_size), "img_size": img,
                        "device": "cpu", "threads": torch.get_num_threads(),
                        "statistic": "median seconds between consecutive batch starts, best of 2 alternations"}
            print(f"{cfg.name}: plain loop {metrics['plain_step_s'] * 1e3:.2f} ms/step, Lightning "
                  f"{metrics['lightning_step_s'] * 1e3:.2f} ms/step: overhead {100 * metrics['lightning_overhead']:+.1f} %")
        run.complete(metrics, protocol)
    return run.result


def run_audit(args: argparse.Namespace, results_dir: Path) -> dict[str, Any]:
    """``vitexp-audit {bspf,saper,raptor}``: the report ``results/audit/<paper>.md`` and a ledger entry (kind audit)."""
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    with owned_run(f"{args.paper}_audit", "audit", results_dir) as run:
        run.start(config)
        if args.paper == "raptor":
            from vitexp.analysis import audit_raptor as auditor

            findings = auditor.audit(args.sizes)
        elif args.paper == "saper":
            from vitexp.analysis import audit_saper as auditor

            findings = auditor.audit(args.saper_run, args.weights, args.images, args.clusters, args.selections, results_dir)
        else:
            from vitexp.analysis import audit_bspf as auditor

            findings = auditor.audit(args.micro_run, args.deit_small, args.images, results_dir)
        report = auditor.render(findings)
        out = atomic_write(results_dir / "audit" / f"{args.paper}.md", report)
        print(report)
        metrics, protocol = auditor.summary(findings)
        report_path = portable_path(out, results_dir)
        run.complete(metrics, protocol, out={"report": str(out)}, report=report_path, findings=findings)
    return run.result


def run_analyze(cfg: DictConfig, args: argparse.Namespace, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Laplace maps, head clusters or RAPTOR's phases of the configured backbone, a token method's
    source maps, or the heads of SAPER run ``record`` (``vitexp-analyze``)."""
    from vitexp.analysis import heads as head_analysis
    from vitexp.build import build_configured_backbone, build_datamodule, data_config_for, pretrained_artifacts

    analysis_dir = Path(cfg.results_dir) / "analysis"
    if args.analysis in ("tokens", "heads"):
        return _run_report(cfg, args, record, analysis_dir)
    with owned_run(cfg.name, "analyze", cfg.results_dir, cfg.output_dir, cfg.logger) as run:
        validate(cfg, need_trainer=False)
        run.start({**to_container(cfg), "analysis": vars(args)})
        model = build_configured_backbone(cfg).eval()
        datamodule = build_datamodule(cfg, data_config_for(cfg, model))
        datamodule.setup("test")
        test = datamodule.test_set
        prefix = int(getattr(model, "num_prefix_tokens", 1))
        out = analysis_dir / f"{cfg.name}_{args.analysis}.png"
        if args.analysis == "laplace":
            metrics = head_analysis.laplace_grid(model, test[args.image_index][0], prefix, out)
        elif args.analysis == "phases":
            from vitexp.analysis.phases import phase_report

            datamodule.setup("fit")
            metrics = phase_report(model, datamodule.train_eval_dataloader(), args.images, args.f, args.blocks, out)
            print("\n".join(metrics["phases_text"]))
        else:
            import torch

            n = min(args.images, len(test))
            images = torch.stack([test[i][0] for i in range(n)])
            metrics = head_analysis.head_clusters(model, images, prefix, args.clusters, out)
        if run.logger and hasattr(run.logger, "log_image"):
            run.logger.log_image(key=args.analysis, images=[str(out)])
        print(f"{cfg.name}: {args.analysis} -> {out}")
        figure = portable_path(out, cfg.results_dir)
        run.complete({k: v for k, v in metrics.items() if k not in ("labels", "distance_matrix")},
                     {"resolution": int(cfg.backbone.img_size), "registers": prefix - 1},
                     out={"figure": str(out), "metrics": metrics}, figure=figure, head_clusters=metrics.get("labels"),
                     distance_matrix=metrics.get("distance_matrix"), artifacts=pretrained_artifacts(model, cfg.results_dir))
    return run.result


def _run_report(cfg: DictConfig, args: argparse.Namespace, record: dict[str, Any] | None,
                analysis_dir: Path) -> dict[str, Any]:
    """``vitexp-analyze tokens|heads`` (vitexp/analysis/reports.py): PNGs, W&B images, ledger paths."""
    from vitexp.analysis import reports

    with owned_run(cfg.name, "analyze", cfg.results_dir, cfg.output_dir, cfg.logger) as run:
        checked = cfg
        if args.analysis == "tokens" and cfg.backbone.get("pretrained"):  # a trained method model's weights
            checked = cfg.copy()  # do not fit the bare backbone: reports.token_model loads them, or says why not
            with open_dict(checked):
                checked.backbone.pretrained = None
        validate(checked, need_trainer=False)
        reports.check_request(cfg, args.analysis, record)
        extra = {"analyzes": record["run_id"]} if record else {}
        run.start({**to_container(cfg), "analysis": vars(args), **extra})
        if args.analysis == "tokens":
            report = reports.token_report(cfg, args, analysis_dir)
        else:
            report = reports.head_report(cfg, record, args, analysis_dir)
        figures = [Path(f) for f in report.pop("figures")]
        if run.logger and hasattr(run.logger, "log_image"):
            run.logger.log_image(key=args.analysis, images=[str(f) for f in figures])
        for f in figures:
            print(f"{cfg.name}: {args.analysis} -> {f}")
        metrics = {k: v for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        run.complete(metrics, {"resolution": int(cfg.backbone.img_size)},
                     out={"figures": [str(f) for f in figures]},
                     figures=[portable_path(f, cfg.results_dir) for f in figures], **extra,
                     **{k: v for k, v in report.items() if k not in metrics})
    return run.result


def _compose_experiment(name: str) -> DictConfig:
    """The config of experiment ``name`` (``conf/experiment/<name>.yaml``), else of the table row
    recorded under ``name`` (a base experiment and overrides, :mod:`vitexp.rows`: EViT's keep rates
    and ToMe's r are rows of the DeiT-S specs), composed beside the running Hydra app (or standalone)."""
    from hydra import compose as hydra_compose
    from hydra.core.global_hydra import GlobalHydra

    overrides = [f"experiment={name}"] if (CONF_DIR / "experiment" / f"{name}.yaml").is_file() else _row_job(name)
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="train", overrides=overrides)
    from vitexp.config import compose

    return compose(overrides)


def _row_job(name: str) -> list[str]:
    """The job of the table row recorded under ``name`` (unseeded, no weights: a timing needs none)."""
    from vitexp.rows import job_arguments
    from vitexp.tables import row_by_name

    row = row_by_name(name)
    if row is not None:
        return job_arguments(row, seeded=False, weights=False)
    raise ConfigError(f"bench.compare: {name!r} is neither an experiment (conf/experiment/{name}.yaml) nor the "
                      f"name of a table row (sweeps/*.yaml)")


def run_compare(cfg: DictConfig) -> dict[str, Any]:
    """``bench.compare=[A, B, ...]``: the deployed models of several experiments timed in one
    interleaved run (:func:`vitexp.bench.compare_throughput`) on ``bench.*``'s device, batch and
    precision. A is the reference: each experiment gets a bench ledger entry with its images/s,
    its speedup over A (``throughput_ratio``) and A's GMACs over its own (``gmacs_ratio``). The
    machine's load average before and after goes into the protocol (a shared CPU shows there).
    Each entry has its own :func:`vitexp.run.owned_run` (no logger: one W&B run per row would split
    one measurement); one closing JSON line lists them all, also when the timing fails (then each
    entry is marked failed)."""
    import contextlib
    import os

    from vitexp.bench import bench_device, compare_throughput
    from vitexp.build import build_model
    from vitexp.flops import count_macs
    from vitexp.run import emit

    names = [str(n) for n in cfg.bench.compare]
    if len(names) < 2 or len(set(names)) != len(names):
        raise ConfigError(f"bench.compare: {names} must name at least two different experiments (the first is the reference)")
    subs = {}
    for name in names:
        sub = _compose_experiment(name)
        with open_dict(sub):
            sub.output_dir, sub.results_dir, sub.bench, sub.logger = cfg.output_dir, cfg.results_dir, cfg.bench, cfg.logger
        validate(sub, need_data=False)
        objective_for(sub).check_timed(sub)
        subs[name] = sub
    sizes = {int(sub.backbone.img_size) for sub in subs.values()}
    if len(sizes) != 1:
        raise ConfigError(f"bench.compare: the experiments run at different resolutions {sorted(sizes)}")
    img = sizes.pop()
    runs: dict[str, Any] = {}  # the owners entered so far: a failure names the entries they started
    try:
        with contextlib.ExitStack() as stack:  # one owner per experiment's entry, one closing line for all
            for name in names:
                runs[name] = stack.enter_context(owned_run(name, "bench", cfg.results_dir, None, None, emits=False))
                runs[name].start(to_container(subs[name]))
            b = cfg.bench
            device = bench_device(str(b.device))
            models, gmacs = {}, {}
            for name, sub in subs.items():
                model, method, _ = build_model(sub)
                deployed = method.deploy(model)
                gmacs[name] = count_macs(deployed, img).gmacs
                models[name] = deployed.to(device)
            load_before = os.getloadavg()
            res = compare_throughput(models, b.batch_size, img, warmup=int(b.warmup), rounds=int(b.rounds),
                                     iters=int(b.iters), amp=b.amp, progress=True)
            load_after = os.getloadavg()
            ref = names[0]
            for name in names:
                metrics = {"throughput": res[name]["throughput"], "baseline_throughput": res[ref]["throughput"],
                           "throughput_ratio": res[name]["throughput"] / res[ref]["throughput"],
                           "gmacs": gmacs[name], "baseline_gmacs": gmacs[ref], "gmacs_ratio": gmacs[ref] / gmacs[name]}
                protocol = {"mode": "compare", "interleaved": True, "interleaved_with": names, "reference": ref,
                            **{k: v for k, v in res[name].items() if k != "throughput"}, "statistic": "median over rounds",
                            "load_average_1m_before_after": [load_before[0], load_after[0]], "cpu_count": os.cpu_count()}
                print(f"{name}: {metrics['throughput']:.1f} images/s, speedup {metrics['throughput_ratio']:.2f} over {ref} "
                      f"(GMACs ratio {metrics['gmacs_ratio']:.2f}, {gmacs[name]:.3f} GMACs)")
                runs[name].complete(metrics, protocol)
            print(f"batch {res[ref]['batch_size']}, {img} px, {res[ref]['device_name']}, {res[ref]['precision']}, "
                  f"{res[ref]['threads']} threads, load average {load_before[0]:.1f} -> {load_after[0]:.1f} "
                  f"on {os.cpu_count()} CPUs")
    except Exception as err:  # each owner marked its entry failed; one closing line names them
        started = [r for r in runs.values() if r.ledger is not None]
        emit({"status": "failed", "error": portable_text(f"{type(err).__name__}: {one_line(err)}", cfg.results_dir),
              "ledger": [portable_path(r.ledger.path, cfg.results_dir) for r in started],
              "run_id": [r.ledger.run_id for r in started]})
        err.vitexp_reported = True
        raise
    return {"metrics": {n: r.result["metrics"] for n, r in runs.items()},
            "ledger": [r.result["ledger"] for r in runs.values()],
            "run_id": [r.result["run_id"] for r in runs.values()], "status": "completed"}
