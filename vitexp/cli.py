"""Console scripts. The Hydra apps (vitexp-train, vitexp-flops, vitexp-bench) compose
``conf/train.yaml``; vitexp-sweep and vitexp-tables take plain arguments.

Every command ends its standard output with one line of JSON: the run's metrics and the ledger
path (``{"status": "failed", "error": ...}`` when it fails, with a non-zero exit code).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, open_dict

from vitexp import CONF_DIR
from vitexp.config import ConfigError, group_choices, run_name, to_container, validate


def _print_result(payload: dict[str, Any]) -> None:
    sys.stderr.flush()
    print(json.dumps(payload, default=str), flush=True)


def _name_from_command_line(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    overrides = list(HydraConfig.get().overrides.task)
    with open_dict(cfg):
        cfg.name = run_name(cfg, group_choices(), overrides)


def _hydra_app(body: Callable[[DictConfig], dict[str, Any]]) -> Callable[[DictConfig], Any]:
    """Wrap a run body: name the run, print the closing JSON line, exit non-zero on failure."""

    def task(cfg: DictConfig):
        _name_from_command_line(cfg)
        try:
            result = body(cfg)
        except ConfigError as err:
            print(f"vitexp: invalid config: {err}", file=sys.stderr)
            _print_result({"status": "invalid", "error": str(err), "ledger": None})
            raise SystemExit(2) from None
        except Exception as err:
            _print_result({"status": "failed", "error": f"{type(err).__name__}: {err}",
                           "ledger": getattr(err, "ledger_path", None)})
            raise
        from vitexp.train import is_rank_zero

        if is_rank_zero():  # one closing line per command, from the process that owns the ledger
            _print_result({"status": "completed", **result})
        return result.get("metrics")

    return task


def _run_hydra(body: Callable[[DictConfig], dict[str, Any]]) -> None:
    import hydra

    # Hydra reads sys.argv; its own errors (unknown group option or key) name the valid choices.
    main = hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")(_hydra_app(body))
    main()


def _close_run(cfg: DictConfig, ledger, config: dict[str, Any], job_type: str, metrics: dict[str, Any],
               protocol: dict[str, Any], **extra: Any) -> Path:
    """A finished flops/bench run: its metrics to the logger (a short W&B run of ``job_type``),
    then its ledger entry closed as completed."""
    from vitexp.logging_utils import build_logger, finish, log_final, wandb_url

    logger = build_logger(cfg.logger, cfg.name, Path(cfg.output_dir), config, job_type=job_type)
    try:
        log_final(logger, metrics)
        path = ledger.finish(metrics, protocol, wandb_url=wandb_url(logger), **extra)
    except BaseException:
        finish(logger, failed=True)
        raise
    finish(logger)
    return path


# -- vitexp-train --------------------------------------------------------------------------------
def _train_body(cfg: DictConfig) -> dict[str, Any]:
    from vitexp.train import train

    return train(cfg)


def train_main() -> None:
    """Train, test and record one run (or a multirun with -m)."""
    _run_hydra(_train_body)


# -- vitexp-flops --------------------------------------------------------------------------------
def run_flops(cfg: DictConfig) -> dict[str, Any]:
    """Params and MACs of the configured model as deployed, without training; one ledger entry."""
    from vitexp.flops import count_heads, count_macs
    from vitexp.results import LedgerEntry
    from vitexp.train import build_model, registers_of

    validate(cfg, need_data=False)
    config = to_container(cfg)
    ledger = LedgerEntry(cfg.name, "flops", config, cfg.results_dir).start()
    try:
        model, method, data_config = build_model(cfg)
        deployed = method.deploy(model)
        from vitexp.detection import detection_flops, detector_for, wants_detection

        if wants_detection(cfg):
            deployed = detector_for(cfg, deployed, data_config)
            metrics, det_protocol = detection_flops(cfg, deployed)
            report = count_macs(deployed.backbone.body.model, int(cfg.backbone.img_size))  # the backbone alone, at its resolution
            metrics.update({"heads": count_heads(deployed), "backbone_gmacs": report.gmacs})
            protocol = {**det_protocol, "num_classes": int(cfg.data.num_classes)}
        else:
            report = count_macs(deployed, int(cfg.backbone.img_size), registers=registers_of(cfg))
            metrics = {**report.metrics(), "heads": count_heads(deployed)}
            protocol = {**report.protocol, "num_classes": int(cfg.data.num_classes)}
        where = f"{protocol['resolution']} (the whole detector)" if wants_detection(cfg) else f"{cfg.backbone.img_size} px"
        parts = ({k[6:]: v for k, v in metrics.items() if k.startswith("gmacs_")} if wants_detection(cfg)
                 else report.by_module)
        print(f"{cfg.name}: {metrics['params_m']:.2f} M params, {metrics['gmacs']:.3f} GMACs "
              f"({metrics['gflops']:.3f} GFLOPs = 2 x MACs) at {where}, "
              f"attention matmuls counted; by module (GMACs): "
              + ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if v > 0))
        path = _close_run(cfg, ledger, config, "flops", metrics, protocol, by_module=report.by_module)
        return {"metrics": metrics, "protocol": protocol, "ledger": str(path), "run_id": ledger.run_id}
    except BaseException as err:
        if ledger.record["status"] == "running":
            ledger.fail(err)
        raise


def flops_main() -> None:
    """Count params and FLOPs of a configured model (no training)."""
    _run_hydra(run_flops)


# -- vitexp-bench --------------------------------------------------------------------------------
def run_bench(cfg: DictConfig) -> dict[str, Any]:
    """``bench.mode=throughput``: the method's deployed model against its unmodified backbone,
    interleaved, images/s and their ratio beside the GMACs ratio. ``bench.mode=overhead``:
    Lightning's per-step overhead against a plain PyTorch loop on the same model and batches."""
    from vitexp.bench import bench_device, compare_throughput, lightning_overhead
    from vitexp.flops import count_macs
    from vitexp.results import LedgerEntry
    from vitexp.train import build_configured_backbone, build_datamodule, build_model

    if cfg.bench.mode not in ("throughput", "overhead"):
        raise ConfigError(f"bench.mode: {cfg.bench.mode!r} is not one of ('throughput', 'overhead')")
    validate(cfg, need_data=cfg.bench.mode == "overhead")
    config = to_container(cfg)
    ledger = LedgerEntry(cfg.name, "bench", config, cfg.results_dir).start()
    try:
        import torch

        img = int(cfg.backbone.img_size)
        b = cfg.bench
        if b.mode == "throughput":
            model, method, _ = build_model(cfg)
            deployed = method.deploy(model)
            baseline = build_configured_backbone(cfg)
            macs_m = count_macs(deployed, img).gmacs
            macs_b = count_macs(baseline, img).gmacs
            device = bench_device(str(b.device))
            res = compare_throughput({"method": deployed.to(device), "baseline": baseline.to(device)}, int(b.batch_size),
                                     img, warmup=int(b.warmup), rounds=int(b.rounds), iters=int(b.iters), amp=bool(b.amp))
            metrics = {
                "throughput": res["method"]["throughput"],
                "baseline_throughput": res["baseline"]["throughput"],
                "throughput_ratio": res["method"]["throughput"] / res["baseline"]["throughput"],
                "gmacs": macs_m,
                "baseline_gmacs": macs_b,
                "gmacs_ratio": macs_b / macs_m,
            }
            protocol = {"mode": "throughput", "interleaved": True, **res["method"], "statistic": "median over rounds"}
            protocol.pop("throughput", None)
            print(f"{cfg.name}: {metrics['throughput']:.1f} vs baseline {metrics['baseline_throughput']:.1f} images/s "
                  f"(ratio {metrics['throughput_ratio']:.2f}; GMACs ratio {metrics['gmacs_ratio']:.2f}), "
                  f"batch {b.batch_size}, {img} px, {protocol['device_name']}, {protocol['precision']}, "
                  f"{torch.get_num_threads()} threads")
        else:
            model, method, data_config = build_model(cfg)
            if method.objective != "classify":
                raise ConfigError(f"bench.mode=overhead times the classify objective; method {method.name} is {method.objective}")
            datamodule = build_datamodule(cfg, data_config)
            datamodule.setup("fit")
            import copy

            state = copy.deepcopy(model.state_dict())

            def make_model():
                m = copy.deepcopy(model)
                m.load_state_dict(state)
                return m

            res = lightning_overhead(make_model, datamodule.train_dataloader, int(cfg.data.num_classes),
                                     dict(cfg.recipe), steps=int(b.steps), warmup=int(b.warmup) + 3)
            metrics = dict(res)
            protocol = {"mode": "overhead", "batch_size": int(cfg.recipe.batch_size), "img_size": img,
                        "device": "cpu", "threads": torch.get_num_threads(),
                        "statistic": "median seconds between consecutive batch starts, best of 2 alternations"}
            print(f"{cfg.name}: plain loop {res['plain_step_s'] * 1e3:.2f} ms/step, Lightning "
                  f"{res['lightning_step_s'] * 1e3:.2f} ms/step: overhead {100 * res['lightning_overhead']:+.1f} %")
        path = _close_run(cfg, ledger, config, "bench", metrics, protocol)
        return {"metrics": metrics, "ledger": str(path), "run_id": ledger.run_id}
    except BaseException as err:
        if ledger.record["status"] == "running":
            ledger.fail(err)
        raise


def bench_main() -> None:
    """Throughput of a method against its backbone, or Lightning's step overhead."""
    _run_hydra(run_bench)


# -- vitexp-sweep, vitexp-tables ---------------------------------------------------------------------
def sweep_main(argv: list[str] | None = None) -> None:
    from vitexp.sweep import main

    raise SystemExit(main(argv))


def tables_main(argv: list[str] | None = None) -> None:
    from vitexp.tables import main

    raise SystemExit(main(argv))


def audit_main(argv: list[str] | None = None) -> None:
    """``vitexp-audit {bspf,raptor}``: measure the public review's objections (BSPF-ViT) or decompose
    SAPER's FLOPs comparison with RAPTOR; writes ``results/audit/<paper>.md`` and a ledger entry
    (kind audit)."""
    import argparse
    import os
    import tempfile

    from vitexp.results import LedgerEntry, default_results_dir

    audits = ("bspf", "raptor")
    parser = argparse.ArgumentParser(prog="vitexp-audit", description=audit_main.__doc__)
    parser.add_argument("paper", choices=audits, help="which paper's claims to audit")
    parser.add_argument("--micro-checkpoint", help="Lightning checkpoint of a trained micro ViT (default: train one, ~30 s)")
    parser.add_argument("--deit-small", help="local DeiT-S weights file (default: random initialisation, said so)")
    parser.add_argument("--images", type=int, default=16, help="digits fed through the micro model (DeiT-S gets a quarter)")
    parser.add_argument("--sizes", nargs="+", choices=("b", "s"), default=["b", "s"],
                        help="raptor: DINOv2 sizes to count (ViT-B, ViT-S)")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    results_dir = args.results_dir or default_results_dir()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    ledger = LedgerEntry(f"{args.paper}_audit", "audit", config, results_dir).start()
    try:
        if args.paper == "raptor":
            from vitexp.analysis import audit_raptor as auditor

            findings = auditor.audit(args.sizes)
        else:
            from vitexp.analysis import audit_bspf as auditor

            findings = auditor.audit(args.micro_checkpoint, args.deit_small, args.images, results_dir)
        report = auditor.render(findings)
        out = results_dir / "audit" / f"{args.paper}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
        with os.fdopen(fd, "w") as fh:
            fh.write(report)
        os.replace(tmp, out)
        metrics, protocol = auditor.summary(findings)
        path = ledger.finish(metrics, protocol, report=str(out), findings=findings)
    except BaseException as err:
        ledger.fail(err)
        _print_result({"status": "failed", "error": f"{type(err).__name__}: {err}", "ledger": str(ledger.path)})
        raise SystemExit(1) from err
    print(report)
    _print_result({"status": "completed", "metrics": metrics, "report": str(out), "ledger": str(path)})


def analyze_main(argv: list[str] | None = None) -> None:
    """``vitexp-analyze {laplace,clusters,phases} [options] [overrides]``: Laplace maps or head
    clustering of the configured backbone (``backbone.pretrained`` for real weights) on the
    configured data's test split, or RAPTOR's layer distance matrix and phases over training images
    (evaluation transforms); a PNG under ``results/analysis/``, a ledger entry (kind analyze),
    W&B images."""
    import argparse

    from vitexp.analysis import heads as head_analysis
    from vitexp.config import compose
    from vitexp.logging_utils import build_logger, finish, wandb_url
    from vitexp.results import LedgerEntry
    from vitexp.train import build_datamodule

    parser = argparse.ArgumentParser(prog="vitexp-analyze", description=analyze_main.__doc__)
    parser.add_argument("analysis", choices=("laplace", "clusters", "phases"))
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. backbone=dinov2_vitb14 backbone.pretrained=/p")
    parser.add_argument("--images", type=int, default=256, help="clusters: test images used; phases: training images")
    parser.add_argument("--f", type=float, default=0.7, help="phases: max-cut threshold fraction f")
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 3, 4], help="phases: block budgets k to partition for")
    parser.add_argument("--image-index", type=int, default=0, help="laplace: which test image")
    parser.add_argument("--clusters", type=int, default=4, help="clusters: number of spectral clusters")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = compose(args.overrides, return_hydra_config=True)
        choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if v}
        with open_dict(cfg):  # no Hydra run directory here: outputs go beside the figures
            del cfg["hydra"]
            cfg.output_dir = str(Path(cfg.results_dir) / "analysis")
            cfg.name = run_name(cfg, choices, args.overrides)
        validate(cfg)
    except Exception as err:  # composition or validation: nothing written
        print(f"vitexp-analyze: {err}", file=sys.stderr)
        _print_result({"status": "invalid", "error": str(err), "ledger": None})
        raise SystemExit(2) from None
    config = {**to_container(cfg), "analysis": vars(args)}
    ledger = LedgerEntry(cfg.name, "analyze", config, cfg.results_dir).start()
    logger = None
    try:
        from vitexp.train import build_configured_backbone, data_config_for

        model = build_configured_backbone(cfg).eval()
        datamodule = build_datamodule(cfg, data_config_for(cfg, model))
        datamodule.setup("test")
        test = datamodule.test_set
        prefix = int(getattr(model, "num_prefix_tokens", 1))
        out = Path(cfg.results_dir) / "analysis" / f"{cfg.name}_{args.analysis}.png"
        if args.analysis == "laplace":
            image = test[args.image_index][0]
            metrics = head_analysis.laplace_grid(model, image, prefix, out)
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
        logger = build_logger(cfg.logger, cfg.name, Path(cfg.results_dir) / "analysis", config, job_type="analyze")
        if logger and hasattr(logger, "log_image"):
            logger.log_image(key=args.analysis, images=[str(out)])
        path = ledger.finish({k: v for k, v in metrics.items() if k not in ("labels", "distance_matrix")},
                             {"resolution": int(cfg.backbone.img_size), "registers": prefix - 1},
                             figure=str(out), head_clusters=metrics.get("labels"),
                             distance_matrix=metrics.get("distance_matrix"), wandb_url=wandb_url(logger))
    except BaseException as err:
        if ledger.record["status"] == "running":
            ledger.fail(err)
        finish(logger, failed=True)
        _print_result({"status": "failed", "error": f"{type(err).__name__}: {err}", "ledger": str(ledger.path)})
        raise SystemExit(1) from err
    finish(logger)
    print(f"{cfg.name}: {args.analysis} -> {out}")
    _print_result({"status": "completed", "metrics": metrics, "figure": str(out), "ledger": str(path)})


_APPS = {"train": train_main, "flops": flops_main, "bench": bench_main, "sweep": sweep_main, "tables": tables_main,
         "audit": audit_main, "analyze": analyze_main}

if __name__ == "__main__":  # python -m vitexp.cli {train,flops,bench,sweep,tables} [args]
    if len(sys.argv) < 2 or sys.argv[1] not in _APPS:
        print(f"usage: python -m vitexp.cli {{{','.join(_APPS)}}} [args]", file=sys.stderr)
        raise SystemExit(2)
    app = _APPS[sys.argv.pop(1)]
    app()
