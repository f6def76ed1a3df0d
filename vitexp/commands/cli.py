"""Console scripts. The Hydra apps (vitexp-train, vitexp-flops, vitexp-bench) compose ``conf/train.yaml``;
vitexp-eval, vitexp-analyze, vitexp-audit, vitexp-sweep and vitexp-tables take plain arguments.

Its reasoning: docs/commands.md, "vitexp/commands/cli.py".
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, open_dict

from vitexp import CONF_DIR

# registers the resolvers conf/train.yaml uses
from vitexp.config import composition as _composition  # noqa: F401
from vitexp.errors import HYDRA_FULL_ERROR_BY_VITEXP, ConfigError, console_script, debug_mode, one_line
from vitexp.runs.owner import ArgumentParser, emit, remove_if_empty

#: Lightning strategies that re-run the command line in worker processes.
_SUBPROCESS_STRATEGIES = ("ddp", "ddp_find_unused_parameters_true")


def _report(
    status: str, err: BaseException, prog: str, message: str | None = None, debug: bool | None = None
) -> None:
    """One line on stderr (``<prog>: invalid|failed: ...``, naming the key or the file; the
    traceback before it only under :func:`~vitexp.errors.debug_mode`), and the closing JSON line
    unless the run owner printed it already."""
    from vitexp.ledger import portable_text

    # stderr and the closing line name a path alike: relative when it lies in the checkout, the results or the
    # run
    message = portable_text(
        message or one_line(err),
        getattr(err, "vitexp_results_dir", None),
        [getattr(err, "vitexp_run_dir", None)],
    )
    if debug_mode() if debug is None else debug:
        traceback.print_exception(err)
    print(
        f"{prog}: {status}: " + (message if status == "invalid" else f"{type(err).__name__}: {message}"),
        file=sys.stderr,
    )
    if not getattr(err, "vitexp_reported", False):
        emit({"status": status, "error": f"{type(err).__name__}: {message}", "ledger": None})


def _invalid(err: BaseException, prog: str = "vitexp") -> None:
    """Exit 2 with the ``invalid`` closing line (unless a run owner printed it already)."""
    _report("invalid", err, prog)
    raise SystemExit(2) from None


def _device_count(devices: Any, accelerator: str) -> int:
    """How many devices Lightning will use for ``trainer.devices``: a count, a list of ids, or
    ``auto``/-1 (every visible GPU on a GPU accelerator, one CPU process otherwise)."""
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        return len(devices)
    text = str(devices)
    if text in ("auto", "-1"):
        import torch

        return (
            torch.cuda.device_count()
            if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
            else 1
        )
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
            f"trainer.strategy={cfg.trainer.strategy} with trainer.devices={devices} inside a local multirun"
            " (-m): Lightning's DDP workers re-run the command line, i.e. the whole sweep. Run each job"
            " alone (vitexp-train experiment=X trainer=ddp), or sweep through SLURM: hydra/launcher=slurm"
            " hydra.launcher.tasks_per_node=<devices> (docs/cluster.md)"
        )


def _hydra_app(body: Callable[[DictConfig], dict[str, Any]], prog: str) -> Callable[[DictConfig], Any]:
    """Wrap a run body: check every key's type, name the run, check the overrides; exit 2 on an
    invalid config, 1 on a failure (the body's run owner prints the closing JSON line of a run it
    started). In a multirun a failed job does not stop the others (:mod:`vitexp.runs.multirun`)."""

    def task(cfg: DictConfig):
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from vitexp.config.composition import check_overrides, group_choices, run_name
        from vitexp.config.schema import check_types

        hydra_cfg = HydraConfig.get()
        try:
            check_types(cfg)
            overrides = list(hydra_cfg.overrides.task)
            with open_dict(cfg):
                cfg.name = run_name(cfg, group_choices(), overrides)
            check_overrides(cfg, overrides)
            _refuse_ddp_in_local_multirun(cfg, hydra_cfg)
            result = body(cfg)
        except ConfigError as err:
            if not getattr(err, "vitexp_reported", False):
                remove_if_empty(Path(cfg.output_dir))
            _invalid(err, prog)
        except Exception as err:  # noqa: BLE001 - reported in one line; the traceback under VITEXP_DEBUG=1
            _report("failed", err, prog)
            if hydra_cfg.mode == RunMode.MULTIRUN:
                return None
            raise SystemExit(1) from None
        return result.get("metrics")

    return task


def _check_ledger(prog: str) -> None:
    """Refuse to start, before Hydra writes anything, while a pack of the results root the run would
    resume from or load weights by (its ``results_dir=`` override, else ``$VITEXP_RESULTS`` or
    ``results/``; not checked for a sweep or an interpolation of it) cannot be read."""
    from vitexp.ledger import LedgerError, default_results_dir
    from vitexp.ledger.packs import check_packs

    given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.lstrip("+").startswith("results_dir=")]
    if given and any(c in given[-1] for c in ",${}"):
        return
    try:
        check_packs(Path(given[-1]) if given else default_results_dir())
    except LedgerError as err:
        _report("failed", err, prog, f"{one_line(err)}; nothing was started (fix or remove the file)")
        raise SystemExit(1) from None


def _run_hydra(body: Callable[[DictConfig], dict[str, Any]], prog: str) -> None:
    """Run a Hydra app; a composition error (``backbone=nope``, ``recipe.lrr=1``) also ends with
    the JSON line, in one line (:func:`vitexp.config.composition.composition_error`); a multirun ends with
    its summary line (:func:`vitexp.runs.multirun.summary`); an unreadable pack stops it first
    (:func:`_check_ledger`).
    """
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from vitexp.config.composition import composition_error
    from vitexp.runs import multirun

    if not any(a in ("--help", "-h", "--cfg", "-c", "--info", "--hydra-help") for a in sys.argv[1:]):
        _check_ledger(prog)
    main = hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")(
        _hydra_app(body, prog)
    )
    debug = debug_mode()
    previous = os.environ.get("HYDRA_FULL_ERROR")
    if previous != "1":  # Hydra raises instead of exiting: the error reaches the JSON line
        os.environ.update({"HYDRA_FULL_ERROR": "1", HYDRA_FULL_ERROR_BY_VITEXP: "1"})
    multirun.STARTED.clear()
    code: Any = 0
    try:
        try:
            main()
        finally:
            sys.stdout.flush()  # a reader that left shows here at the latest, not in Python's exit
    except BrokenPipeError:  # the reader left (vitexp-train --help | head): nothing more can be printed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor flushed at exit
        raise SystemExit(1) from None
    except SystemExit as exit_:
        code = exit_.code
    except (
        KeyboardInterrupt
    ):  # Ctrl-C: the run closed its entry ``interrupted`` (vitexp.runs.signals.pass_on)
        code = 128 + int(signal.SIGINT)
    except Exception as err:  # noqa: BLE001 - Hydra's own: composition, a launcher
        invalid = isinstance(err, (HydraException, OmegaConfBaseException))
        _report(
            "invalid" if invalid else "failed",
            err,
            prog,
            composition_error(err, prog) if invalid else None,
            debug,
        )
        code = 2 if invalid else 1
    finally:
        if previous != "1":
            os.environ.pop(HYDRA_FULL_ERROR_BY_VITEXP, None)
            if previous is None:
                os.environ.pop("HYDRA_FULL_ERROR", None)
            else:
                os.environ["HYDRA_FULL_ERROR"] = previous
    closing = multirun.summary(stopped_invalid=code == 2)
    if closing is not None:
        emit(closing)
        code = code or (1 if closing["status"] != "completed" else 0)
    if code:
        raise SystemExit(code)


def _train_body(cfg: DictConfig) -> dict[str, Any]:
    from vitexp.commands.train import train

    return train(cfg)


def _flops_body(cfg: DictConfig) -> dict[str, Any]:
    from vitexp.commands.inspect import run_flops

    return run_flops(cfg)


def _bench_body(cfg: DictConfig) -> dict[str, Any]:
    from vitexp.commands.bench import run_bench

    return run_bench(cfg)


def _rehearse_body(cfg: DictConfig) -> dict[str, Any]:
    from vitexp.commands.rehearse import rehearse

    return rehearse(cfg)


@console_script
def rehearse_main() -> None:
    """One row's rehearsal (``python -m vitexp.commands.rehearse_main``; ``vitexp-sweep TABLE --rehearse``
    launches it)."""
    _run_hydra(_rehearse_body, "vitexp-rehearse")


@console_script
def train_main() -> None:
    """Train, test and record one run (or a multirun with -m)."""
    _run_hydra(_train_body, "vitexp-train")


@console_script
def flops_main() -> None:
    """Count params and FLOPs of a configured model (no training)."""
    _run_hydra(_flops_body, "vitexp-flops")


@console_script
def bench_main() -> None:
    """Throughput of a method against its backbone, or Lightning's step overhead."""
    _run_hydra(_bench_body, "vitexp-bench")


def _exit_failed(err: BaseException, prog: str) -> None:
    """Exit 1 with one line on stderr and the ``failed`` closing line (unless a run owner printed it)."""
    _report("failed", err, prog)
    raise SystemExit(1) from None


@console_script
def eval_main(argv: list[str] | None = None) -> None:
    """``vitexp-eval RUN_ID_OR_EXPERIMENT [overrides] [--weights PATH]``: rebuild the model a
    completed train run saved and test it on the run's test split (a ledger entry of kind eval)."""

    from vitexp.commands.evaluate import eval_config, evaluate

    parser = ArgumentParser(prog="vitexp-eval", description=eval_main.__doc__)
    parser.add_argument("run", help="a completed train run's id, or an experiment (its newest completed run)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.root=/datasets/imagenet")
    parser.add_argument(
        "--weights", help="weights.pth or a vitexp Lightning checkpoint (default: the run's weights)"
    )
    args = parser.parse_intermixed_args(argv)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg, record = eval_config(args.run, args.overrides)
    except (ConfigError, FileNotFoundError, ValueError, HydraException, OmegaConfBaseException) as err:
        _invalid(err, "vitexp-eval")  # an unknown run, option or key: nothing ran
    except Exception as err:
        _exit_failed(err, "vitexp-eval")
    try:
        evaluate(cfg, record, args.weights)
    except ConfigError as err:
        _invalid(err, "vitexp-eval")
    except Exception as err:
        _exit_failed(err, "vitexp-eval")


def _closing_line_on_error(
    main: Callable[[list[str] | None], int], argv: list[str] | None, prog: str
) -> None:
    """Run a non-Hydra app's ``main``; an error it does not report itself still ends with the JSON line."""
    try:
        code = main(argv)
    except Exception as err:
        _exit_failed(err, prog)
    raise SystemExit(code)


@console_script
def sweep_main(argv: list[str] | None = None) -> None:
    from vitexp.commands.sweep import main

    _closing_line_on_error(main, argv, "vitexp-sweep")


@console_script
def tables_main(argv: list[str] | None = None) -> None:
    from vitexp.report.tables import main

    _closing_line_on_error(main, argv, "vitexp-tables")


@console_script
def audit_main(argv: list[str] | None = None) -> None:
    """``vitexp-audit {bspf,saper,raptor}``: measure the public review's objections (BSPF-ViT, SAPER) or
    decompose SAPER's FLOPs comparison with RAPTOR; writes ``results/audit/<paper>.md`` and a ledger
    entry (kind audit)."""

    from vitexp.analysis import audit_saper
    from vitexp.commands.inspect import run_audit
    from vitexp.ledger import default_results_dir

    parser = ArgumentParser(prog="vitexp-audit", description=audit_main.__doc__)
    parser.add_argument("paper", choices=("bspf", "saper", "raptor"), help="which paper's claims to audit")
    parser.add_argument(
        "--micro-run",
        default="run:demo",
        help="bspf: the trained micro ViT, a ledger train run: run:<experiment> (its newest) or run:<run_id>",
    )
    parser.add_argument(
        "--deit-small",
        help="bspf: DeiT-S weights, a local file or run:<...> (default: random init, seed 0, said so)",
    )
    parser.add_argument(
        "--images",
        type=int,
        default=None,
        help=(
            "bspf: digits fed through the micro model, DeiT-S gets a quarter (default 16); "
            "saper: test images for the attention and the head clusters (default 256)"
        ),
    )
    parser.add_argument(
        "--saper-run",
        nargs="+",
        default=list(audit_saper.SAPER_RUNS),
        help=(
            "saper: SAPER train runs whose kept_heads are audited, run:<experiment> (its newest) or"
            " run:<run_id>"
        ),
    )
    parser.add_argument(
        "--weights",
        help=(
            "saper: the pruned backbone's weights, a local file (e.g. a real DINOv2 for a "
            "paper-scale SAPER run; default: the teacher run the SAPER run loaded)"
        ),
    )
    parser.add_argument(
        "--clusters",
        type=int,
        nargs="+",
        default=list(audit_saper.CLUSTERS),
        help="saper: spectral cluster counts",
    )
    parser.add_argument(
        "--selections", type=int, default=10_000, help="saper: random head selections for chance"
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        choices=("b", "s"),
        default=["b", "s"],
        help="raptor: DINOv2 sizes to count (ViT-B, ViT-S)",
    )
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.images is None:
        args.images = 256 if args.paper == "saper" else 16
    try:
        run_audit(args, args.results_dir or default_results_dir())
    except Exception as err:
        _exit_failed(err, "vitexp-audit")


@console_script
def analyze_main(argv: list[str] | None = None) -> None:
    """``vitexp-analyze {laplace,clusters,phases,tokens,heads,splits} [options] [overrides]``: Laplace maps
    or head clustering of the configured backbone (``backbone.pretrained`` for real weights) on the
    configured data's test split, RAPTOR's layer distance matrix and phases over training images
    (evaluation transforms), a token method's source maps per test image (``tokens``), or a SAPER
    run's kept heads and scores beside the head clusters (``heads --run RUN``); PNGs under
    ``results/analysis/``, a ledger entry (kind analyze), W&B images. ``splits --runs A B``: two
    classifiers' paired difference on their validation and test splits with its image-sampling
    error (a paired bootstrap over images) and the gap between the splits, as JSON."""

    from vitexp.commands.inspect import analyze_config, heads_config, run_analyze, run_splits, splits_configs

    parser = ArgumentParser(prog="vitexp-analyze", description=analyze_main.__doc__)
    parser.add_argument("analysis", choices=("laplace", "clusters", "phases", "tokens", "heads", "splits"))
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. backbone=dinov2_vitb14 backbone.pretrained=/p"
    )
    parser.add_argument(
        "--images",
        type=int,
        default=None,
        help=(
            "clusters, heads: test images clustered (256); phases: training images (256); "
            "tokens: test images drawn, one PNG each (4)"
        ),
    )
    parser.add_argument(
        "--run", help="heads: the SAPER train run, its id or experiment (its newest completed run)"
    )
    parser.add_argument("--f", type=float, default=0.7, help="phases: max-cut threshold fraction f")
    parser.add_argument(
        "--blocks", type=int, nargs="+", default=[2, 3, 4], help="phases: block budgets k to partition for"
    )
    parser.add_argument("--image-index", type=int, default=0, help="laplace: which test image")
    parser.add_argument("--clusters", type=int, default=4, help="clusters: number of spectral clusters")
    parser.add_argument(
        "--runs",
        nargs=2,
        metavar=("RUN_A", "RUN_B"),
        help="splits: two completed train runs, ids or experiments (their newest); difference a - b",
    )
    parser.add_argument("--boot", type=int, default=2000, help="splits: bootstrap replicates over images")
    parser.add_argument("--seed", type=int, default=0, help="splits: the bootstrap's generator seed")
    parser.add_argument(
        "--out", help="splits: the JSON report (default results/analysis/splits_<a>_<b>.json)"
    )
    args = parser.parse_intermixed_args(argv)
    if args.images is None:
        args.images = 4 if args.analysis == "tokens" else 256
    record = pairs = None
    try:
        if args.analysis == "splits":  # two runs on different data too: nothing written
            pairs = splits_configs(args.runs, args.overrides)
        elif args.analysis == "heads":
            cfg, record = heads_config(args.run, args.overrides)
        else:
            cfg = analyze_config(args.overrides)
    except Exception as err:  # composition: nothing written
        _invalid(err, "vitexp-analyze")
    try:
        run_splits(pairs, args) if pairs else run_analyze(cfg, args, record)
    except ConfigError as err:
        _invalid(err, "vitexp-analyze")
    except Exception as err:
        _exit_failed(err, "vitexp-analyze")


_APPS = {
    "train": train_main,
    "flops": flops_main,
    "bench": bench_main,
    "eval": eval_main,
    "sweep": sweep_main,
    "tables": tables_main,
    "audit": audit_main,
    "analyze": analyze_main,
    "rehearse": rehearse_main,
}

if (
    __name__ == "__main__"
):  # python -m vitexp.commands.cli {train,flops,bench,eval,sweep,tables,audit,analyze} [args]
    if len(sys.argv) < 2 or sys.argv[1] not in _APPS:
        print(f"usage: python -m vitexp.commands.cli {{{','.join(_APPS)}}} [args]", file=sys.stderr)
        raise SystemExit(2)
    app = _APPS[sys.argv.pop(1)]
    app()
