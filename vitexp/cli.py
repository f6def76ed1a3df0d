"""Console scripts. The Hydra apps (vitexp-train, vitexp-flops, vitexp-bench) compose
``conf/train.yaml``; vitexp-eval, vitexp-analyze, vitexp-audit, vitexp-sweep and vitexp-tables
take plain arguments.

Every command ends its standard output with one line of JSON: the run's metrics and the ledger
path, ``{"status": "invalid", ...}`` (exit code 2) for a config or command line that cannot run,
Hydra's composition errors included, and ``{"status": "failed", ...}`` (exit code 1) when it fails.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, open_dict

from vitexp import CONF_DIR
from vitexp import config as _config  # noqa: F401  (registers the resolvers conf/train.yaml uses)
from vitexp.errors import ConfigError
from vitexp.run import emit, remove_if_empty
from vitexp.run import ArgumentParser

#: Lightning strategies that re-run the command line in worker processes.
_SUBPROCESS_STRATEGIES = ("ddp", "ddp_find_unused_parameters_true")


def _invalid(err: BaseException, prog: str = "vitexp") -> None:
    """Exit 2 with the ``invalid`` closing line (unless a run owner printed it already)."""
    print(f"{prog}: invalid: {err}", file=sys.stderr)
    if not getattr(err, "vitexp_reported", False):
        emit({"status": "invalid", "error": f"{type(err).__name__}: {err}", "ledger": None})
    raise SystemExit(2) from None


def _device_count(devices: Any, accelerator: str) -> int:
    """How many devices Lightning will use for ``trainer.devices``: a count, a list of ids, or
    ``auto``/-1 (every visible GPU on a GPU accelerator, one CPU process otherwise)."""
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        return len(devices)
    text = str(devices)
    if text in ("auto", "-1"):
        import torch

        return torch.cuda.device_count() if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available() else 1
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return int(text) if text.lstrip("-").isdigit() else 1


def _refuse_ddp_in_local_multirun(cfg: DictConfig, hydra_cfg) -> None:
    """Lightning's subprocess DDP re-runs ``sys.argv`` in each worker; inside a local ``-m`` sweep
    that would rerun the whole sweep there. Refused, pointing to the SLURM launcher."""
    from hydra.types import RunMode

    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    local = "BasicLauncher" in str(hydra_cfg.launcher.get("_target_", ""))
    devices, strategy = cfg.trainer.get("devices", 1), str(cfg.trainer.get("strategy"))
    several = _device_count(devices, str(cfg.trainer.get("accelerator", "auto"))) > 1
    # strategy=auto picks Lightning's subprocess DDP for more than one device, as strategy=ddp does
    if multirun and local and strategy in (*_SUBPROCESS_STRATEGIES, "auto") and several:
        raise ConfigError(
            f"trainer.strategy={cfg.trainer.strategy} with trainer.devices={devices} inside a local multirun (-m): "
            "Lightning's DDP workers re-run the command line, i.e. the whole sweep. Run each job alone "
            "(vitexp-train experiment=X trainer=ddp), or sweep through SLURM: hydra/launcher=slurm "
            "hydra.launcher.tasks_per_node=<devices> (README, 'Reproducing the tables on a GPU cluster')")


def _hydra_app(body: Callable[[DictConfig], dict[str, Any]]) -> Callable[[DictConfig], Any]:
    """Wrap a run body: name the run, check the overrides, exit 2 on an invalid config (the body's
    run owner prints the closing JSON line of a run it started)."""

    def task(cfg: DictConfig):
        from hydra.core.hydra_config import HydraConfig

        from vitexp.config import check_overrides, group_choices, run_name

        hydra_cfg = HydraConfig.get()
        try:
            overrides = list(hydra_cfg.overrides.task)
            with open_dict(cfg):
                cfg.name = run_name(cfg, group_choices(), overrides)
            check_overrides(cfg, overrides)
            _refuse_ddp_in_local_multirun(cfg, hydra_cfg)
            result = body(cfg)
        except ConfigError as err:
            if not getattr(err, "vitexp_reported", False):
                remove_if_empty(Path(cfg.output_dir))
                emit({"status": "invalid", "error": f"ConfigError: {err}", "ledger": None})
            print(f"vitexp: invalid config: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        return result.get("metrics")

    return task


def _run_hydra(body: Callable[[DictConfig], dict[str, Any]]) -> None:
    """Run a Hydra app; a composition error (``backbone=nope``, ``recipe.lrr=1``) also ends with
    the JSON line. Hydra names the valid options on stderr."""
    import hydra

    main = hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")(_hydra_app(body))
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of exiting: the error reaches the JSON line
    try:
        try:
            main()
        finally:
            sys.stdout.flush()  # a reader that left shows here at the latest, not in Python's exit
    except BrokenPipeError:  # the reader left (vitexp-train --help | head): nothing more can be printed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor flushed at exit
        raise SystemExit(1) from None
    except Exception as err:
        if getattr(err, "vitexp_reported", False):
            raise
        cause = f" ({err.__cause__})" if err.__cause__ and str(err.__cause__) not in str(err) else ""
        print(f"vitexp: {err}{cause}", file=sys.stderr)
        emit({"status": "invalid", "error": f"{type(err).__name__}: {err}{cause}", "ledger": None})
        raise SystemExit(2) from None
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def _train_body(cfg: DictConfig) -> dict[str, Any]:
    from vitexp.train import train

    return train(cfg)


def _flops_body(cfg: DictConfig) -> dict[str, Any]:
    from vitexp.commands import run_flops

    return run_flops(cfg)


def _bench_body(cfg: DictConfig) -> dict[str, Any]:
    from vitexp.commands import run_bench

    return run_bench(cfg)


def train_main() -> None:
    """Train, test and record one run (or a multirun with -m)."""
    _run_hydra(_train_body)


def flops_main() -> None:
    """Count params and FLOPs of a configured model (no training)."""
    _run_hydra(_flops_body)


def bench_main() -> None:
    """Throughput of a method against its backbone, or Lightning's step overhead."""
    _run_hydra(_bench_body)


def _exit_failed(err: BaseException) -> None:
    """A run owner already printed the closing line: exit 1 without a second one."""
    if not getattr(err, "vitexp_reported", False):
        emit({"status": "failed", "error": f"{type(err).__name__}: {err}", "ledger": None})
    raise SystemExit(1) from err


def eval_main(argv: list[str] | None = None) -> None:
    """``vitexp-eval RUN_ID_OR_EXPERIMENT [overrides] [--weights PATH]``: rebuild the model a
    completed train run saved and test it on the run's test split (a ledger entry of kind eval)."""

    from vitexp.evaluate import evaluate, eval_config

    parser = ArgumentParser(prog="vitexp-eval", description=eval_main.__doc__)
    parser.add_argument("run", help="a completed train run's id, or an experiment (its newest completed run)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.root=/datasets/imagenet")
    parser.add_argument("--weights", help="weights.pth or a vitexp Lightning checkpoint (default: the run's weights)")
    args = parser.parse_intermixed_args(argv)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg, record = eval_config(args.run, args.overrides)
    except (ConfigError, FileNotFoundError, ValueError, HydraException, OmegaConfBaseException) as err:
        _invalid(err, "vitexp-eval")  # an unknown run, option or key: nothing ran
    except Exception as err:
        _exit_failed(err)
    try:
        evaluate(cfg, record, args.weights)
    except ConfigError as err:
        _invalid(err, "vitexp-eval")
    except Exception as err:
        _exit_failed(err)


def _closing_line_on_error(main: Callable[[list[str] | None], int], argv: list[str] | None) -> None:
    """Run a non-Hydra app's ``main``; an error it does not report itself still ends with the JSON line."""
    try:
        code = main(argv)
    except Exception as err:
        _exit_failed(err)
    raise SystemExit(code)


def sweep_main(argv: list[str] | None = None) -> None:
    from vitexp.sweep import main

    _closing_line_on_error(main, argv)


def tables_main(argv: list[str] | None = None) -> None:
    from vitexp.tables import main

    _closing_line_on_error(main, argv)


def audit_main(argv: list[str] | None = None) -> None:
    """``vitexp-audit {bspf,saper,raptor}``: measure the public review's objections (BSPF-ViT, SAPER) or
    decompose SAPER's FLOPs comparison with RAPTOR; writes ``results/audit/<paper>.md`` and a ledger
    entry (kind audit)."""

    from vitexp.analysis import audit_saper
    from vitexp.commands import run_audit
    from vitexp.results import default_results_dir

    parser = ArgumentParser(prog="vitexp-audit", description=audit_main.__doc__)
    parser.add_argument("paper", choices=("bspf", "saper", "raptor"), help="which paper's claims to audit")
    parser.add_argument("--micro-run", default="run:demo",
                        help="bspf: the trained micro ViT, a ledger train run: run:<experiment> (its newest) or run:<run_id>")
    parser.add_argument("--deit-small", help="bspf: DeiT-S weights, a local file or run:<...> (default: random init, seed 0, said so)")
    parser.add_argument("--images", type=int, default=None,
                        help="bspf: digits fed through the micro model, DeiT-S gets a quarter (default 16); "
                             "saper: test images for the attention and the head clusters (default 256)")
    parser.add_argument("--saper-run", nargs="+", default=list(audit_saper.SAPER_RUNS),
                        help="saper: SAPER train runs whose kept_heads are audited, run:<experiment> (its newest) or run:<run_id>")
    parser.add_argument("--weights", help="saper: the pruned backbone's weights, a local file (e.g. a real DINOv2 for a "
                                          "paper-scale SAPER run; default: the teacher run the SAPER run loaded)")
    parser.add_argument("--clusters", type=int, nargs="+", default=list(audit_saper.CLUSTERS), help="saper: spectral cluster counts")
    parser.add_argument("--selections", type=int, default=10_000, help="saper: random head selections for chance")
    parser.add_argument("--sizes", nargs="+", choices=("b", "s"), default=["b", "s"],
                        help="raptor: DINOv2 sizes to count (ViT-B, ViT-S)")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.images is None:
        args.images = 256 if args.paper == "saper" else 16
    try:
        run_audit(args, args.results_dir or default_results_dir())
    except Exception as err:
        _exit_failed(err)


def analyze_main(argv: list[str] | None = None) -> None:
    """``vitexp-analyze {laplace,clusters,phases,tokens,heads} [options] [overrides]``: Laplace maps
    or head clustering of the configured backbone (``backbone.pretrained`` for real weights) on the
    configured data's test split, RAPTOR's layer distance matrix and phases over training images
    (evaluation transforms), a token method's source maps per test image (``tokens``), or a SAPER
    run's kept heads and scores beside the head clusters (``heads --run RUN``); PNGs under
    ``results/analysis/``, a ledger entry (kind analyze), W&B images."""

    from vitexp.commands import run_analyze

    parser = ArgumentParser(prog="vitexp-analyze", description=analyze_main.__doc__)
    parser.add_argument("analysis", choices=("laplace", "clusters", "phases", "tokens", "heads"))
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. backbone=dinov2_vitb14 backbone.pretrained=/p")
    parser.add_argument("--images", type=int, default=None,
                        help="clusters, heads: test images clustered (256); phases: training images (256); "
                             "tokens: test images drawn, one PNG each (4)")
    parser.add_argument("--run", help="heads: the SAPER train run, its id or experiment (its newest completed run)")
    parser.add_argument("--f", type=float, default=0.7, help="phases: max-cut threshold fraction f")
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 3, 4], help="phases: block budgets k to partition for")
    parser.add_argument("--image-index", type=int, default=0, help="laplace: which test image")
    parser.add_argument("--clusters", type=int, default=4, help="clusters: number of spectral clusters")
    args = parser.parse_intermixed_args(argv)
    if args.images is None:
        args.images = 4 if args.analysis == "tokens" else 256
    record = None
    try:
        if args.analysis == "heads":
            cfg, record = _heads_config(args)
        else:
            cfg = _analyze_config(args)
    except Exception as err:  # composition: nothing written
        _invalid(err, "vitexp-analyze")
    try:
        run_analyze(cfg, args, record)
    except ConfigError as err:
        _invalid(err, "vitexp-analyze")
    except Exception as err:
        _exit_failed(err)


def _analyze_config(args):
    """The composed config of ``vitexp-analyze`` (outputs beside the figures)."""
    from vitexp.config import check_overrides, compose, run_name

    cfg = compose(args.overrides, return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if v}
    with open_dict(cfg):  # no Hydra run directory here: outputs go beside the figures
        del cfg["hydra"]
        cfg.output_dir = str(Path(cfg.results_dir) / "analysis")
        cfg.name = run_name(cfg, choices, args.overrides)
    check_overrides(cfg, args.overrides)
    return cfg


def _heads_config(args):
    """The SAPER run's own config (overrides as ``vitexp-eval`` takes them) and its ledger record."""
    from vitexp.evaluate import eval_config

    if not args.run:
        raise ConfigError("vitexp-analyze heads needs --run <SAPER train run id or experiment>")
    cfg, record = eval_config(args.run, args.overrides)
    with open_dict(cfg):
        cfg.output_dir = str(Path(cfg.results_dir) / "analysis")
        cfg.name = f"{record['experiment']}_heads"
    return cfg, record


_APPS = {"train": train_main, "flops": flops_main, "bench": bench_main, "eval": eval_main, "sweep": sweep_main,
         "tables": tables_main, "audit": audit_main, "analyze": analyze_main}

if __name__ == "__main__":  # python -m vitexp.cli {train,flops,bench,eval,sweep,tables,audit,analyze} [args]
    if len(sys.argv) < 2 or sys.argv[1] not in _APPS:
        print(f"usage: python -m vitexp.cli {{{','.join(_APPS)}}} [args]", file=sys.stderr)
        raise SystemExit(2)
    app = _APPS[sys.argv.pop(1)]
    app()
