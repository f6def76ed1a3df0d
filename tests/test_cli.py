"""The console scripts as a user runs them: closing JSON line, exit codes, ledger entries."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env, ledger_entries

BIN = Path(sys.executable).parent


def run(
    app: str, *args: str, results_dir: Path, cwd: Path, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / app), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=cli_env(results_dir),
        timeout=timeout,
    )


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_flops_cli_prints_params_and_gmacs(results_dir, tmp_path, monkeypatch, capfd):
    code, out, err = _in_process(
        "flops", ["experiment=deit_small_baseline", "logger=none"], results_dir, tmp_path, monkeypatch, capfd
    )
    assert code == 0, err[-2000:]
    result = last_json(out)
    assert result["status"] == "completed"
    assert result["metrics"]["gmacs"] == pytest.approx(4.61, abs=0.02)
    assert result["metrics"]["params_m"] == pytest.approx(22.05, abs=0.05)
    assert result["protocol"]["resolution"] == 224 and result["protocol"]["registers"] == 0
    (entry,) = ledger_entries(results_dir)
    assert entry["kind"] == "flops" and entry["experiment"] == "deit_small_baseline"
    assert result["ledger"] == f"runs/{entry['run_id']}.json"  # relative to the results root: no machine path


def test_bench_throughput_records_both_models(results_dir, tmp_path, monkeypatch, capfd):
    code, out, err = _in_process(
        "bench",
        ["logger=none", "bench.batch_size=8", "bench.rounds=2", "bench.iters=2"],
        results_dir,
        tmp_path,
        monkeypatch,
        capfd,
    )
    assert code == 0, err[-2000:]
    m = last_json(out)["metrics"]
    assert m["throughput"] > 0 and m["baseline_throughput"] > 0
    assert m["gmacs_ratio"] == pytest.approx(1.0)  # baseline method: the same model twice
    (entry,) = ledger_entries(results_dir)
    assert entry["kind"] == "bench" and entry["protocol"]["interleaved"] is True


def test_bench_train_step_records_training_images_per_second(results_dir, tmp_path, monkeypatch, capfd):
    """The measurement a lent GPU's factor comes from (scripts/gpu_check.sh anchor), here on the CPU."""
    code, out, err = _in_process(
        "bench",
        [
            "logger=none",
            "bench.mode=train_step",
            "bench.batch_size=4",
            "bench.rounds=2",
            "bench.iters=2",
            "bench.warmup=1",
        ],
        results_dir,
        tmp_path,
        monkeypatch,
        capfd,
    )
    assert code == 0, err[-2000:]
    (entry,) = ledger_entries(results_dir)
    assert (
        entry["kind"] == "bench"
        and entry["protocol"]["mode"] == "train_step"
        and entry["protocol"]["batch_size"] == 4
    )
    assert entry["metrics"]["train_images_per_s"] > 0 and entry["protocol"]["device"] == "cpu"
    assert entry["protocol"]["train_images_per_s_min"] <= entry["metrics"]["train_images_per_s"]


def test_sweep_runs_rows_then_skips_completed_ones(results_dir, tmp_path, monkeypatch, capfd):
    """vitexp-sweep and vitexp-tables through their entry points in this process; the flops
    multirun the sweep launches is the real console script."""

    def sweep(*args):
        return _in_process(
            "sweep", ["demo", "--kind", "flops", *args], results_dir, tmp_path, monkeypatch, capfd
        )

    code, out, err = sweep("logger=none")
    assert code == 0, err[-2000:]
    summary = last_json(out)
    assert summary["launched"]["flops"] == ["demo", "deit_tiny_baseline", "deit_small_baseline"]
    assert "++logger.group=demo ++logger.tags=[demo]" in err  # W&B runs grouped by table
    entries = ledger_entries(results_dir)
    assert sorted(e["experiment"] for e in entries) == ["deit_small_baseline", "deit_tiny_baseline", "demo"]
    again = last_json(sweep("logger=none", "--dry-run")[1])
    assert (
        again["status"] == "dry_run" and again["would_launch"] == {} and len(again["skipped"]["flops"]) == 3
    )
    assert "launched" not in again and again["commands"] == []
    forced = last_json(sweep("--force", "--dry-run")[1])
    assert forced["status"] == "dry_run" and len(forced["would_launch"]["flops"]) == 3
    (command,) = forced["commands"]
    assert "vitexp-flops -m experiment=demo,deit_tiny_baseline,deit_small_baseline" in command
    assert len(ledger_entries(results_dir)) == 3  # nothing ran
    assert _in_process("tables", ["demo"], results_dir, tmp_path, monkeypatch, capfd)[0] == 0
    md = re.sub(r" +", " ", (results_dir / "tables" / "demo.md").read_text())  # tabulate pads columns
    assert "| DeiT-S (224 px, ImageNet-1K) | not run | 79.8 | 4.599 | 4.6 |" in md


def test_every_exit_of_eval_and_tables_ends_with_the_json_line(monkeypatch, capsys, make_cfg, results_dir):
    """Errors the apps do not report themselves (a Hydra error composing an override, a failure while
    writing a table) still end with the closing JSON line and a non-zero exit."""
    import vitexp.report.tables
    from vitexp.commands.cli import eval_main, tables_main
    from vitexp.config.composition import to_container
    from vitexp.ledger import portable_paths

    (results_dir / "runs").mkdir(parents=True, exist_ok=True)
    (results_dir / "runs" / "r1.json").write_text(
        json.dumps(
            {
                "run_id": "r1",
                "experiment": "demo",
                "status": "completed",
                "kind": "train",
                "started": "2026-01-01T00:00:00+00:00",
                "config": portable_paths(to_container(make_cfg(["logger=none"])), results_dir),
            }
        )
    )
    with pytest.raises(SystemExit) as exited:
        eval_main(["r1", "logger=nope"])  # no such logger option: Hydra's error
    out = capsys.readouterr()
    assert exited.value.code == 2 and last_json(out.out)["status"] == "invalid"
    assert "logger" in last_json(out.out)["error"]

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(vitexp.report.tables, "_write", broken)  # where every table file is written
    with pytest.raises(SystemExit) as exited:
        tables_main(["demo", "--out", "/nonexistent-but-unused"])
    assert exited.value.code == 1
    assert last_json(capsys.readouterr().out) == {
        "status": "failed",
        "error": "OSError: disk full",
        "ledger": None,
    }


@pytest.mark.parametrize("app", ["eval", "sweep", "tables", "audit", "analyze"])
def test_a_usage_error_ends_with_the_invalid_line(app, capsys):
    """argparse's own errors (an unknown option) also close with the JSON line, exit 2."""
    from vitexp.commands import cli

    with pytest.raises(SystemExit) as exited:
        first = {"eval": ["r1"], "sweep": ["demo"], "tables": [], "audit": ["bspf"], "analyze": ["tokens"]}[
            app
        ]
        getattr(cli, f"{app}_main")([*first, "--bogus"])
    out = capsys.readouterr()
    closing = last_json(out.out)
    assert exited.value.code == 2 and closing["status"] == "invalid" and "--bogus" in closing["error"]
    (line,) = out.err.splitlines()  # one line, as every error: no usage block
    assert "--bogus" in line and "--help" in line


def test_an_official_training_checkpoint_with_args_passes_the_cli_checks(
    results_dir, tmp_path, monkeypatch, capfd
):
    """A file as timm's CheckpointSaver, SHViT's main.py and the official T2T-ViT / LV-ViT scripts
    save it (``state_dict`` with a ``module.`` prefix, ``state_dict_ema``, an ``argparse.Namespace``
    under ``args``) passes the checks vitexp-flops runs before it starts (the weights-only load
    allows the Namespace, then the backbone is built with the file) and the run completes."""
    import argparse

    import timm
    import torch

    import vitexp  # noqa: F401  (registers t2t_vit_micro)

    state = timm.create_model("t2t_vit_micro", num_classes=10).state_dict()
    path = tmp_path / "t2t_vit_micro.pth.tar"
    torch.save(
        {
            "state_dict": {f"module.{k}": v for k, v in state.items()},
            "state_dict_ema": state,
            "args": argparse.Namespace(model="t2t_vit_micro", lr=1e-3, model_ema=True),
            "epoch": 309,
        },
        path,
    )
    code, out, err = _in_process(
        "flops",
        ["backbone=t2t_vit_micro", f"backbone.pretrained={path}", "logger=none"],
        results_dir,
        tmp_path,
        monkeypatch,
        capfd,
    )
    assert code == 0, err[-2000:]
    assert last_json(out)["status"] == "completed"
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed" and entry["config"]["backbone"]["pretrained"]


def _checkpoints(folder: Path) -> dict[str, Path]:
    """Weights files a new user might pass: random bytes, an empty file, another model's keys, a
    pickled Python object (what ``weights_only=True`` refuses)."""
    import os

    import torch

    folder.mkdir(parents=True, exist_ok=True)
    files = {name: folder / f"{name}.pth" for name in ("random", "empty", "wrong_keys", "pickled")}
    files["random"].write_bytes(os.urandom(4096))
    files["empty"].write_bytes(b"")
    torch.save({"foo.weight": torch.zeros(3)}, files["wrong_keys"])
    torch.save({"model": Path("a path object, not a tensor")}, files["pickled"])
    return files


RAPTOR = ["method=raptor", "budget=blocks", "backbone=dinov2_micro_reg", "data=synthetic"]
BAD_INPUTS = [  # (overrides, what the one line names); {ckpt:NAME} is a file from _checkpoints
    (["recipe.lr=abc"], "recipe.lr"),
    (["seed=1.5"], "seed"),
    (["method=bspf", "budget=keep_ratio", "method.keep_warmup_epochs=soon"], "method.keep_warmup_epochs"),
    (["trainer.precision=bf17"], "trainer.precision"),
    (["+trainer.foo=1"], "trainer.foo"),
    (["recipe.lrr=1"], "recipe.lrr"),
    (["~recipe.lr"], "recipe.lr"),
    (["backbone=nope"], "Available options in 'backbone': caformer_micro"),
    (["recipe.epochs=0"], "recipe.epochs"),
    (["name=.."], "name='..': the run folder outputs/../ would not be a folder of its own"),  # issue 58
    (
        ["++logger.tags=[" + "t" * 65 + "]"],
        "logger.tags: '" + "t" * 65 + "' is not a tag of 1 to 64 characters",
    ),
    (["recipe.lr=${nope}"], "recipe.lr: ${nope} does not resolve"),  # the key, not hydra.run.dir
    (["backbone.pretrained={ckpt:random}"], "{ckpt:random}"),
    (["backbone.pretrained={ckpt:empty}"], "{ckpt:empty}"),
    (["backbone.pretrained={ckpt:wrong_keys}"], "{ckpt:wrong_keys}"),
    (["backbone.pretrained={ckpt:pickled}"], "{ckpt:pickled}"),
    (["trainer=gpu"], "trainer.accelerator"),
    (["trainer.accelerator=tpu"], "trainer.accelerator=tpu"),
    (["+trainer.enable_checkpointing=false"], "trainer.enable_checkpointing: set by vitexp"),
    (["+foo=1"], "foo: not a key of the config"),
    *[
        ([*RAPTOR, f"method.{key}={{ckpt:{name}}}"], f"{{ckpt:{name}}}")  # RAPTOR's own files
        for key in ("probe_head", "surrogate")
        for name in ("random", "empty", "pickled")
    ],
    ([*RAPTOR, "method.probe.lr=abc"], "method.probe.lr"),  # recipe keys of the probe stages
    ([*RAPTOR, "+method.probe.lrr=1"], "method.probe.lrr"),
]


def _in_process(
    app: str,
    args: list[str],
    results_dir: Path,
    cwd: Path,
    monkeypatch,
    capfd,
    env: dict[str, str] | None = None,
) -> tuple[int, str, str]:
    """``vitexp-<app> ARGS`` (a Hydra app: train, flops, bench) through its entry point in this
    process, with ``env`` added: (exit code, stdout, stderr). Every logger's handlers and level are
    restored afterwards (Hydra configures logging for the job it starts, and a library imported
    during the call, such as Lightning, binds a handler to this test's captured stream, closed when
    the test ends)."""
    import logging

    from vitexp.commands import cli

    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    saved = {id(lg): (list(lg.handlers), lg.level) for lg in loggers}
    for key, value in {**cli_env(results_dir), **(env or {})}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [f"vitexp-{app}", *args])
    capfd.readouterr()
    try:
        getattr(cli, f"{app}_main")()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        for lg in [
            logging.getLogger(),
            *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict)),
        ]:
            if isinstance(lg, logging.Logger):
                lg.handlers[:], level = saved.get(id(lg), ([], lg.level))
                lg.setLevel(level)
    out, err = capfd.readouterr()
    return code, out, err


def _check_refused(code: int, stdout: str, stderr: str, names: str, results_dir: Path, cwd: Path) -> None:
    """Exit 2, exactly one line on stderr naming the key or the file (never advising
    weights_only=False, nor Hydra's refused +key form), the invalid closing JSON line saying the
    same, no ledger entry and no run folder."""
    lines = stderr.splitlines()
    assert code == 2, stderr[-2000:]
    assert len(lines) == 1 and names in lines[0], stderr[-2000:]
    closing = last_json(stdout)
    named = Path(names).name  # the closing line's paths are portable (vitexp.ledger.portable_text)
    assert closing["status"] == "invalid" and named in closing["error"] and "\n" not in closing["error"]
    assert "weights_only=False" not in stderr + stdout and "+recipe.lrr" not in stderr
    assert list((results_dir / "runs").iterdir()) == []
    assert not (cwd / "outputs").exists()


def _bad_input(overrides: list[str], names: str, tmp_path: Path, results_dir: Path) -> tuple[list[str], str]:
    """The case's arguments and expected name with its checkpoint files made ({ckpt:NAME})."""
    if overrides == ["trainer=gpu"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    files = _checkpoints(tmp_path / "ckpt")
    fill = lambda text: re.sub(r"\{ckpt:(\w+)\}", lambda m: str(files[m.group(1)]), text)  # noqa: E731
    (results_dir / "runs").mkdir(parents=True)
    return [*map(fill, overrides), "logger=none"], fill(names)


@pytest.mark.parametrize("overrides, names", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_a_bad_input_is_one_line_naming_it_and_writes_nothing(
    overrides, names, results_dir, tmp_path, monkeypatch, capfd
):
    """Each bad input stops vitexp-train before anything starts (:func:`_check_refused`), called
    through its entry point in this process; :func:`test_the_console_script_refuses_a_bad_input`
    runs some of them as a user does."""
    args, names = _bad_input(overrides, names, tmp_path, results_dir)
    refused = _in_process("train", args, results_dir, tmp_path, monkeypatch, capfd)
    _check_refused(*refused, names, results_dir, tmp_path)


CONSOLE_CASES = [
    case
    for case in BAD_INPUTS
    if case[0]
    in (
        ["recipe.lr=abc"],
        ["backbone=nope"],
        ["recipe.lr=${nope}"],
        ["backbone.pretrained={ckpt:pickled}"],
        [*RAPTOR, "method.probe_head={ckpt:random}"],
    )
]


@pytest.mark.parametrize("overrides, names", CONSOLE_CASES, ids=[" ".join(o) for o, _ in CONSOLE_CASES])
def test_the_console_script_refuses_a_bad_input(overrides, names, results_dir, tmp_path):
    """The same refusal from the installed ``vitexp-train`` in its own process: a type error, an
    unknown group option, an interpolation, a checkpoint file, a file of RAPTOR's own."""
    args, names = _bad_input(overrides, names, tmp_path, results_dir)
    proc = run("vitexp-train", *args, results_dir=results_dir, cwd=tmp_path)
    _check_refused(proc.returncode, proc.stdout, proc.stderr, names, results_dir, tmp_path)


def test_an_unknown_key_says_how_to_see_the_valid_keys(results_dir, tmp_path, monkeypatch, capfd):
    _, _, stderr = _in_process("train", ["recipe.lrr=1"], results_dir, tmp_path, monkeypatch, capfd)
    (line,) = stderr.splitlines()
    assert "--cfg job" in line and "'lr'" in line and "'epochs'" in line


def test_a_failed_run_is_one_line_and_its_traceback_only_in_debug(results_dir, tmp_path, monkeypatch, capfd):
    """A run that fails inside training: exit 1, its last stderr line names the error, no
    traceback, the closing JSON line and its ledger entry say failed; with VITEXP_DEBUG=1 the
    traceback is there too."""
    args = [
        "data=synthetic",
        "data.noise=nan",
        "data.num_train=32",
        "recipe.batch_size=16",
        "recipe.epochs=1",
        "recipe.warmup_epochs=0",
        "logger=none",
        "trainer.enable_progress_bar=false",
        "eval.throughput=false",
    ]
    code, out, err = _in_process("train", args, results_dir, tmp_path, monkeypatch, capfd)
    assert code == 1
    assert err.splitlines()[-1].startswith("vitexp-train: failed: NonFiniteLossError: ")
    assert "Traceback" not in err and "Error executing job" not in err
    result = last_json(out)
    assert result["status"] == "failed" and "NonFiniteLossError" in result["error"]
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "failed" and Path(result["ledger"]).name == f"{entry['run_id']}.json"
    code, _, err = _in_process(
        "train", args, results_dir, tmp_path, monkeypatch, capfd, env={"VITEXP_DEBUG": "1"}
    )
    assert code == 1 and "Traceback" in err


@pytest.mark.parametrize("plus", ["+", "++"])
def test_a_key_added_to_a_mapping_of_the_schema_is_accepted(plus, results_dir, tmp_path, monkeypatch, capfd):
    """``backbone.kwargs`` is a mapping (``Dict[str, Any]`` in vitexp.config.schema):
    ``+backbone.kwargs.init_values=1.0``
    adds a timm argument, as ``vitexp.config.composition.compose`` accepts it, and reaches the model
    (LayerScale).
    """
    code, _, err = _in_process(
        "flops",
        ["backbone=dinov2_micro", f"{plus}backbone.kwargs.init_values=1.0", "logger=none"],
        results_dir,
        tmp_path,
        monkeypatch,
        capfd,
    )
    assert code == 0, err[-2000:]
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed" and entry["config"]["backbone"]["kwargs"] == {"init_values": 1.0}


def test_values_from_the_environment_and_optional_warmup_steps_are_accepted(
    results_dir, tmp_path, monkeypatch, capfd
):
    """``${oc.env:SLURM_ARRAY_TASK_ID,3}`` for ``seed`` and ``${oc.env:LR,0.001}`` for ``recipe.lr`` are
    strings that convert losslessly to the integer and float expected: accepted, and recorded as
    those numbers (as a structured config would convert them); ``recipe.warmup_steps=null`` (no
    step warmup) with recipe=raptor too."""
    args = [
        "backbone=dinov2_micro_reg",
        "method=raptor",
        "budget=blocks",
        "recipe=raptor",
        "seed=${oc.env:SLURM_ARRAY_TASK_ID,3}",
        "recipe.lr=${oc.env:LR,0.001}",
        "recipe.warmup_steps=null",
        "logger=none",
    ]
    code, _, err = _in_process(
        "flops",
        args,
        results_dir,
        tmp_path,
        monkeypatch,
        capfd,
        env={"SLURM_ARRAY_TASK_ID": "3", "LR": "0.001"},
    )
    assert code == 0, err[-2000:]
    (entry,) = ledger_entries(results_dir)
    assert entry["config"]["seed"] == 3 and entry["config"]["recipe"]["lr"] == 0.001
    assert entry["config"]["recipe"]["warmup_steps"] is None
    code, _, err = _in_process(
        "flops",
        ["seed=${oc.env:SLURM_ARRAY_TASK_ID}", "logger=none"],
        results_dir,
        tmp_path,
        monkeypatch,
        capfd,
        env={"SLURM_ARRAY_TASK_ID": "3.5"},
    )
    assert code == 2 and "seed: '3.5' is not an integer" in err


def test_bench_on_a_gpu_this_machine_lacks_is_refused_before_its_entry(
    results_dir, tmp_path, monkeypatch, capfd
):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (results_dir / "runs").mkdir(parents=True)
    code, _, err = _in_process(
        "bench", ["bench.device=cuda", "logger=none"], results_dir, tmp_path, monkeypatch, capfd
    )
    (line,) = err.splitlines()
    assert code == 2 and "bench.device=cuda" in line, err[-2000:]
    assert list((results_dir / "runs").iterdir()) == [] and not (tmp_path / "outputs").exists()
