"""The bodies of the commands that do not train: ``vitexp-flops``,
``vitexp-audit``, ``vitexp-analyze``. Each runs inside :func:`vitexp.runs.owner.owned_run`, which owns
its ledger entry, logger and closing JSON line; :mod:`vitexp.commands.cli` parses the command lines."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from vitexp.config.composition import to_container
from vitexp.errors import ConfigError
from vitexp.ledger import atomic_write, atomic_write_json, portable_path
from vitexp.runs.owner import owned_run
from vitexp.training.resolve import resolve


def run_flops(cfg: DictConfig) -> dict[str, Any]:
    """Params and MACs of the configured model as deployed, without training, as its objective counts
    it (:meth:`vitexp.training.objectives.Objective.count`); one ledger entry. Seeded by ``cfg.seed`` first: a
    method whose deployed shape depends on an initialisation (SAPER's initial head scores pick the k
    heads) counts the same model every time, and records it (``method.record()``, e.g. ``kept_heads``)."""
    import lightning as L

    from vitexp.training.build import build_model

    resolved = resolve(cfg, need_data=False)
    objective = resolved.objective
    with owned_run(cfg.name, "flops", cfg.results_dir, cfg.output_dir, cfg.logger) as run:
        run.start(to_container(cfg))
        L.seed_everything(int(cfg.seed), workers=True, verbose=False)
        model, method, data_config = build_model(cfg, resolved.method, resolved.weights)
        count = objective.count(cfg, objective.measured(cfg, method.deploy(model), data_config))
        metrics, protocol = count.metrics, count.protocol
        print(
            f"{cfg.name}: {metrics['params_m']:.2f} M params, {metrics['gmacs']:.3f} GMACs "
            f"({metrics['gflops']:.3f} GFLOPs = 2 x MACs) at {count.where}, "
            "attention matmuls counted; by module (GMACs): "
            + ", ".join(f"{k} {v:.3f}" for k, v in count.parts.items() if v > 0)
        )
        run.complete(
            metrics, protocol, out={"protocol": protocol}, by_module=count.by_module, **method.record()
        )
    return run.result


def run_audit(args: argparse.Namespace, results_dir: Path) -> dict[str, Any]:
    """``vitexp-audit {bspf,saper,raptor}``: the report ``results/audit/<paper>.md`` and a ledger entry (kind
    audit)."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if args.paper == "raptor":  # its models' configs composed and checked here, before the run starts
        from vitexp.analysis import audit_raptor as auditor

        resolved = auditor.resolve_rows(args.sizes)
    with owned_run(f"{args.paper}_audit", "audit", results_dir) as run:
        run.start(config)
        if args.paper == "raptor":
            findings = auditor.audit(args.sizes, resolved)
        elif args.paper == "saper":
            from vitexp.analysis import audit_saper as auditor

            findings = auditor.audit(
                args.saper_run, args.weights, args.images, args.clusters, args.selections, results_dir
            )
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


def run_analyze(
    cfg: DictConfig, args: argparse.Namespace, record: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Laplace maps, head clusters or RAPTOR's phases of the configured backbone, a token method's
    source maps, or the heads of SAPER run ``record`` (``vitexp-analyze``)."""
    from vitexp.analysis import heads as head_analysis
    from vitexp.training.build import (
        build_configured_backbone,
        build_datamodule,
        data_config_for,
        pretrained_artifacts,
    )

    analysis_dir = Path(cfg.results_dir) / "analysis"
    if args.analysis in ("tokens", "heads"):
        return _run_report(cfg, args, record, analysis_dir)
    resolved = resolve(cfg, need_trainer=False)
    with owned_run(cfg.name, "analyze", cfg.results_dir, cfg.output_dir, cfg.logger) as run:
        run.start({**to_container(cfg), "analysis": vars(args)})
        model = build_configured_backbone(cfg, resolved.weights).eval()
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
            metrics = phase_report(
                model, datamodule.train_eval_dataloader(), args.images, args.f, args.blocks, out
            )
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
        run.complete(
            {k: v for k, v in metrics.items() if k not in ("labels", "distance_matrix")},
            {"resolution": int(cfg.backbone.img_size), "registers": prefix - 1},
            out={"figure": str(out), "metrics": metrics},
            figure=figure,
            head_clusters=metrics.get("labels"),
            distance_matrix=metrics.get("distance_matrix"),
            artifacts=pretrained_artifacts(model, cfg.results_dir),
        )
    return run.result


def _run_report(
    cfg: DictConfig, args: argparse.Namespace, record: dict[str, Any] | None, analysis_dir: Path
) -> dict[str, Any]:
    """``vitexp-analyze tokens|heads`` (vitexp/analysis/reports.py): PNGs, W&B images, ledger paths."""
    from vitexp.analysis import reports
    from vitexp.config.weights import resolve_weights

    reports.check_request(cfg, args.analysis, record)
    if args.analysis == "heads":
        reports.pin_teacher(cfg, record)
    checked = cfg
    if args.analysis == "tokens" and cfg.backbone.get("pretrained"):  # a trained method model's weights
        checked = cfg.copy()  # do not fit the bare backbone: reports.token_model loads them, or says why not
        with open_dict(checked):
            checked.backbone.pretrained = None
    resolved = resolve(checked, need_trainer=False)
    path = resolved.weights if checked is cfg else resolve_weights(cfg.backbone.pretrained, cfg.results_dir)
    with owned_run(cfg.name, "analyze", cfg.results_dir, cfg.output_dir, cfg.logger) as run:
        extra = {"analyzes": record["run_id"]} if record else {}
        run.start({**to_container(cfg), "analysis": vars(args), **extra})
        if args.analysis == "tokens":
            report = reports.token_report(cfg, args, analysis_dir, path)
        else:
            report = reports.head_report(cfg, record, args, analysis_dir, path)
        figures = [Path(f) for f in report.pop("figures")]
        if run.logger and hasattr(run.logger, "log_image"):
            run.logger.log_image(key=args.analysis, images=[str(f) for f in figures])
        for f in figures:
            print(f"{cfg.name}: {args.analysis} -> {f}")
        metrics = {k: v for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        run.complete(
            metrics,
            {"resolution": int(cfg.backbone.img_size)},
            out={"figures": [str(f) for f in figures]},
            figures=[portable_path(f, cfg.results_dir) for f in figures],
            **extra,
            **{k: v for k, v in report.items() if k not in metrics},
        )
    return run.result


def splits_configs(runs: list[str] | None, overrides: list[str]) -> list[tuple[DictConfig, dict[str, Any]]]:
    """``vitexp-analyze splits``: the two train runs' own configs (overrides as ``vitexp-eval`` takes
    them) and ledger records; a :class:`ConfigError` when they are not two or use different data."""
    from vitexp.analysis.splits import check_same_data
    from vitexp.commands.evaluate import eval_config

    if not runs or len(runs) != 2:
        raise ConfigError("vitexp-analyze splits needs --runs RUN_A RUN_B (train run ids or experiments)")
    pairs = [eval_config(run, overrides) for run in runs]
    check_same_data([record for _, record in pairs])
    return pairs


def run_splits(pairs: list[tuple[DictConfig, dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """``vitexp-analyze splits``: both runs' per-image correctness on their validation and test splits
    and the paired bootstrap of their difference (:mod:`vitexp.analysis.splits`); the JSON report
    ``results/analysis/splits_<a>_<b>.json`` (or ``--out``) and a ledger entry (kind analyze)."""
    from vitexp.analysis import splits
    from vitexp.commands.evaluate import load_deployed, resolve_rebuild

    records = [record for _, record in pairs]
    ids = [splits.short_id(r["run_id"]) for r in records]
    results_dir = Path(pairs[0][0].results_dir)
    name = f"splits_{ids[0]}_{ids[1]}"
    out = Path(args.out) if args.out else results_dir / "analysis" / f"{name}.json"
    resolved = [resolve_rebuild(cfg, record) for cfg, record in pairs]
    with owned_run(name, "analyze", results_dir, results_dir / "analysis" / "run" / name) as run:
        # bad weights: before the entry
        deployed = [load_deployed(r, cfg, record) for r, (cfg, record) in zip(resolved, pairs)]
        config = {
            "analysis": "splits",
            "runs": [r["run_id"] for r in records],
            "boot": args.boot,
            "seed": args.seed,
            "overrides": list(args.overrides),
            "out": portable_path(out, results_dir),
        }
        run.start(config)
        predicted = [splits.predict(cfg, record, d) for (cfg, record), d in zip(pairs, deployed)]
        prefixes = [d.stage.metrics_prefix or "" for d in deployed]
        report = splits.analyse(predicted, records, prefixes, args.boot, args.seed)
        atomic_write_json(out, report)
        print(f"{splits.summary(report)} -> {out}")
        metrics = {f"{split}_{k}": report[split][k] for split in ("val", "test") for k in ("diff", "se")}
        metrics.update({f"gap_{k}": v for k, v in report["gap"].items()})
        run.complete(
            metrics,
            {"accuracy_unit": "percentage points", "boot": args.boot, "seed": args.seed},
            out={"report": str(out)},
            report=portable_path(out, results_dir),
            analyzes=config["runs"],
        )
    return run.result


def analyze_config(overrides: list[str]) -> DictConfig:
    """The composed config of ``vitexp-analyze``: its figures go to ``results/analysis/``, its run's
    own files (lock, code patch) to ``results/analysis/run/<name>/`` (not committed)."""
    from vitexp.config.composition import check_overrides, compose, run_name

    cfg = compose(overrides, return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if v}
    with open_dict(cfg):  # no Hydra run directory here: the run's folder is results/analysis/run/<name>
        del cfg["hydra"]
        cfg.name = run_name(cfg, choices, overrides)
        cfg.output_dir = str(Path(cfg.results_dir) / "analysis" / "run" / cfg.name)
    check_overrides(cfg, overrides)
    return cfg


def heads_config(run: str | None, overrides: list[str]) -> tuple[DictConfig, dict[str, Any]]:
    """The SAPER run's own config (overrides as ``vitexp-eval`` takes them) and its ledger record."""
    from vitexp.commands.evaluate import eval_config

    if not run:
        raise ConfigError("vitexp-analyze heads needs --run <SAPER train run id or experiment>")
    cfg, record = eval_config(run, overrides)
    with open_dict(cfg):
        cfg.name = f"{record['experiment']}_heads"
        cfg.output_dir = str(Path(cfg.results_dir) / "analysis" / "run" / cfg.name)
    return cfg, record
