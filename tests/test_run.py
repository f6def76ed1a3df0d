"""The run owner (vitexp.runs.owner): resume=auto after SIGKILL, stale entries, portable paths, the
closing JSON line on every exit, and the package's shape (no import cycle, short modules)."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
import tokenize
from pathlib import Path

import pytest
from conftest import QUIET, cli_env, config_of, ledger_entries, run_config

ROOT = Path(__file__).resolve().parent.parent
SMALL_RUN = [
    "data=synthetic",
    "data.num_train=64",
    "data.num_val=16",
    "data.num_test=32",
    "recipe.batch_size=16",
    "recipe.epochs=4",
    "recipe.warmup_epochs=1",
    "recipe.mixup=0.8",
    "recipe.drop_path=0.1",
    "eval.throughput=false",
    "eval.flops=false",
    "trainer.enable_progress_bar=false",
    "logger=wandb",
]


def train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vitexp.commands.cli",
        "train",
        *SMALL_RUN,
        "resume=auto",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_resume_auto_after_sigkill_continues_the_same_entry_and_wandb_run(tmp_path):
    """(About 2 minutes of CPU: three processes.) SIGKILL once the first epoch's checkpoint exists, then the
    identical command: one ledger
    entry, completed, with the test metrics of an uninterrupted run, and one W&B run id."""
    whole_results, split_results = tmp_path / "whole_results", tmp_path / "split_results"
    whole = subprocess.run(
        train_cmd(tmp_path / "whole"), env=cli_env(whole_results), capture_output=True, text=True, timeout=600
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = last_json(whole.stdout)["metrics"]

    run_dir = tmp_path / "split"
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(
        train_cmd(run_dir),
        env=cli_env(split_results),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert ckpt.exists(), "the run ended before its first checkpoint"
    (killed,) = ledger_entries(split_results)
    assert killed["status"] == "running", "killed after the run completed: nothing was interrupted"

    again = subprocess.run(
        train_cmd(run_dir), env=cli_env(split_results), capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    (entry,) = ledger_entries(split_results)
    assert entry["run_id"] == killed["run_id"] and entry["status"] == "completed"
    assert len(entry["attempts"]) == 1 and entry["attempts"][0]["status"] == "interrupted"  # closed on resume
    for key in ("top1", "top5", "test_loss", "steps"):
        assert entry["metrics"][key] == pytest.approx(expected[key], rel=1e-6), key
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and {p.name.rsplit("-", 1)[1] for p in wandb_runs} == {entry["wandb_id"]}
    assert json.loads((run_dir / "run.json").read_text())["wandb_id"] == entry["wandb_id"]


class _CrashAtEpoch:
    """A callback that stops the fit as a preemption would, at the start of ``epoch``."""

    def __new__(cls, epoch: int):
        from lightning.pytorch.callbacks import Callback

        class Crash(Callback):
            def on_train_epoch_start(self, trainer, pl_module):
                if trainer.current_epoch == epoch:
                    raise RuntimeError("preempted")

        return Crash()


def test_resume_auto_in_process_reuses_the_entry_and_matches_an_uninterrupted_run(
    make_cfg, results_dir, tmp_path
):
    """The fast variant: a run stopped at epoch 1, then the same config again with resume=auto. The
    same seed trained again from scratch would end with the same metrics: the second attempt's
    ``resumed_from`` (the first attempt's checkpoint, 1 epoch and 2 steps done) is what shows it resumed
    (seen to fail with ``last.ckpt`` ignored)."""
    from vitexp.commands.train import train
    from vitexp.ledger import portable_path

    over = (
        [o for o in SMALL_RUN if not o.startswith(("logger", "recipe.epochs", "data.num_t"))]
        + QUIET[:1]
        + ["resume=auto", "recipe.epochs=3", "data.num_train=32", "data.num_test=16"]
    )
    whole = train(make_cfg(over, tmp_path / "whole"))["metrics"]
    with pytest.raises(RuntimeError, match="preempted"):
        train(make_cfg(over, tmp_path / "split"), callbacks=[_CrashAtEpoch(1)])
    first = [e for e in ledger_entries(results_dir) if e["status"] == "failed"]
    resumed = train(make_cfg(over, tmp_path / "split"))
    entries = ledger_entries(results_dir)
    (entry,) = [e for e in entries if e["run_id"] == resumed["run_id"]]
    assert len(entries) == 2 and entry["run_id"] == first[0]["run_id"] and entry["status"] == "completed"
    assert entry["attempts"][0]["status"] == "failed" and "preempted" in entry["attempts"][0]["error"]
    assert entry["wandb_id"] == json.loads((tmp_path / "split" / "run.json").read_text())["wandb_id"]
    assert resumed["metrics"]["steps"] == whole["steps"]
    assert resumed["metrics"]["top1"] == pytest.approx(whole["top1"]) and resumed["metrics"][
        "test_loss"
    ] == pytest.approx(whole["test_loss"], rel=1e-6)
    assert first[0]["resumed_from"] is None and entry["attempts"][0]["resumed_from"] is None
    ckpt = portable_path(tmp_path / "split" / "checkpoints" / "last.ckpt", results_dir)
    assert entry["resumed_from"] == {
        "main": {"checkpoint": ckpt, "epoch": 1, "global_step": 2}
    }  # 32 images, batch 16
    assert [e["resumed_from"] for e in entries if e["run_id"] != entry["run_id"]] == [
        None
    ]  # the uninterrupted run


def test_resume_refuses_a_folder_that_holds_another_run(make_cfg, results_dir, tmp_path):
    """resume=auto in a folder whose interrupted attempt had another config does not continue that
    run (its entry, W&B run and checkpoint) with this config: it stops before touching them."""
    from vitexp.commands.train import train
    from vitexp.errors import ConfigError

    over = (
        [o for o in SMALL_RUN if not o.startswith(("logger", "recipe.epochs", "data.num_t"))]
        + QUIET[:1]
        + ["resume=auto", "recipe.epochs=2", "data.num_train=32", "data.num_test=16"]
    )
    with pytest.raises(RuntimeError, match="preempted"):
        train(make_cfg(over, tmp_path / "split"), callbacks=[_CrashAtEpoch(1)])
    before = ledger_entries(results_dir)
    with pytest.raises(ConfigError, match="holds run .* config_sha differ"):
        train(make_cfg(over + ["recipe.lr=0.123"], tmp_path / "split"))
    assert ledger_entries(results_dir) == before  # the interrupted entry is untouched, no new one


def test_resume_true_still_requires_a_checkpoint_and_auto_starts_fresh(make_cfg, tmp_path, results_dir):
    from vitexp.runs.owner import resume_checkpoint

    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert resume_checkpoint("auto", ckpt) is None and resume_checkpoint(False, ckpt) is None
    with pytest.raises(FileNotFoundError, match=str(ckpt)):
        resume_checkpoint(True, ckpt)
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"x")
    assert resume_checkpoint("auto", ckpt) == str(ckpt) == resume_checkpoint("true", ckpt)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_running_entry_whose_process_is_gone_is_interrupted(results_dir, tmp_path):
    from vitexp.commands.sweep import plan
    from vitexp.ledger import INTERRUPTED, LedgerEntry, effective_status
    from vitexp.report.tables import fill, load_spec, render_markdown

    alive = LedgerEntry("demo", "train", config_of("demo"), results_dir).start()
    assert effective_status(alive.record) == "running"  # this process
    spec = load_spec("demo")
    assert plan(spec, "train", False, results_dir)["train"]["skip"] == [
        "demo"
    ]  # running now: not launched twice
    alive.record["env"]["pid"] = dead_pid()
    from vitexp.ledger import atomic_write_json

    atomic_write_json(alive.path, alive.record)
    (record,) = ledger_entries(results_dir)
    assert effective_status(record) == INTERRUPTED
    assert "demo" in plan(spec, "train", False, results_dir)["train"]["launch"]
    text = render_markdown(spec, fill(spec, [record]))
    assert INTERRUPTED in text.splitlines()[4]


def test_a_running_entry_from_another_host_is_interrupted_once_its_heartbeat_stops(monkeypatch):
    """A cluster node's entry cannot be checked by pid: it stays running while it beats and reads
    as interrupted once its heartbeat (or, before the first beat, its start) is older than
    $VITEXP_STALE_HOURS (default 6)."""
    import datetime as dt

    from vitexp.ledger import INTERRUPTED, effective_status

    now = dt.datetime(2026, 1, 2, 12, 0, tzinfo=dt.timezone.utc)
    entry = {
        "status": "running",
        "env": {"hostname": "node-17", "pid": 1},
        "started": "2026-01-02T00:00:00+00:00",
    }
    assert effective_status(entry, now) == INTERRUPTED  # 12 h since the start, never beat
    entry["heartbeat"] = "2026-01-02T11:00:00+00:00"
    assert effective_status(entry, now) == "running"  # beat an hour ago
    monkeypatch.setenv("VITEXP_STALE_HOURS", "0.5")
    assert effective_status(entry, now) == INTERRUPTED
    assert effective_status({**entry, "status": "completed"}, now) == "completed"
    assert effective_status({**entry, "heartbeat": "2026-01-02T11:45:00"}, now) == "running"  # no zone: UTC


def test_a_training_run_beats_its_entry(make_cfg, results_dir, tmp_path):
    import unittest.mock

    import vitexp.ledger
    from vitexp.commands.train import train

    beats = []

    original = vitexp.ledger.LedgerEntry.beat

    def counting(self):
        beats.append(self.record["status"])
        original(self)

    with unittest.mock.patch.object(vitexp.ledger.LedgerEntry, "beat", counting):
        result = train(make_cfg(SMALL_RUN + QUIET[:1], tmp_path / "beat"))
    entry = json.loads((results_dir / result["ledger"]).read_text())  # relative to the results root
    assert beats and set(beats) == {"running"} and "heartbeat" in entry
    assert entry["heartbeat"] >= entry["started"]


def test_ledger_paths_are_relative_to_the_results_folder(make_cfg, results_dir):
    from vitexp.commands.train import train
    from vitexp.ledger import local_path

    cfg = make_cfg(
        QUIET
        + [
            "data=synthetic",
            "data.num_train=16",
            "data.num_val=8",
            "data.num_test=8",
            "recipe.batch_size=8",
            "recipe.epochs=1",
            "recipe.warmup_epochs=0",
            "eval.throughput=false",
            "logger=csv",
        ],
        output_dir=results_dir / "outputs" / "r1",
    )
    train(cfg)
    (entry,) = ledger_entries(results_dir)
    text = json.dumps(entry["artifacts"]) + entry["output_dir"]
    assert str(results_dir) not in text and str(ROOT) not in text
    assert entry["artifacts"]["weights"] == "outputs/r1/weights.pth"
    assert (
        local_path(entry["artifacts"]["weights"], results_dir)
        == results_dir / "outputs" / "r1" / "weights.pth"
    )


def run_cli(*args: str, results_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vitexp.commands.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=cli_env(results_dir),
        timeout=300,
    )


@pytest.mark.parametrize(
    "args,needle",
    [  # vitexp-train's other bad inputs: tests/test_cli.py, BAD_INPUTS
        (["train", "+recipe.lrr=1", "logger=none"], "valid keys"),
        (["train", "++recipe.lrr=1", "logger=none"], "valid keys"),
        (["tables", "--wandb", "nobody/nothing"], "W&B"),
    ],
)
def test_every_exit_ends_with_a_json_line_and_leaves_no_empty_folder(args, needle, results_dir, tmp_path):
    env = cli_env(results_dir)
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "vitexp.commands.cli", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env, "WANDB_MODE": "offline", "NETRC": str(tmp_path / "none")},
        timeout=300,
    )
    assert proc.returncode != 0
    result = last_json(proc.stdout)
    assert result["status"] in ("invalid", "failed") and needle in result["error"] + proc.stderr
    if "+recipe.lrr=1" in args or "++recipe.lrr=1" in args:
        assert "lr" in result["error"] and "epochs" in result["error"]  # the recipe group's keys
    assert ledger_entries(results_dir) == []
    assert not (tmp_path / "outputs").exists()


def _vitexp_graph() -> dict[str, set[str]]:
    mods = {}
    for p in (ROOT / "vitexp").rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def owner(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports count too
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("vitexp")
            ):
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else owner(node.module)
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("vitexp")}
        graph[mod] = deps - {mod}
    return graph


def test_vitexp_has_no_import_cycle():
    graph = _vitexp_graph()
    state: dict[str, int] = {}

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            assert state.get(dep) != 1, (
                "import cycle: " + " -> ".join(path[path.index(dep) :] + [dep])
                if dep in path
                else f"import cycle through {dep}"
            )
            if dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not [m for m in ("vitexp.errors",) if graph[m]], "vitexp.errors imports nothing from vitexp"


def _statements(path: Path) -> int:
    """Logical lines (tokenize's NEWLINE tokens: a statement, a docstring): what ruff format leaves as is."""
    with open(path, "rb") as f:
        return sum(t.type == tokenize.NEWLINE for t in tokenize.tokenize(f.readline))


def test_no_module_over_300_statements():
    """Small modules: at most 300 logical lines each (the formatter spreads a statement over as many
    physical lines as its width needs, so the physical count says less about a module's size)."""
    long = {
        str(p.relative_to(ROOT)): n for p in (ROOT / "vitexp").rglob("*.py") if (n := _statements(p)) > 300
    }
    assert not long, long


def test_the_documented_layout_names_every_package_and_module():
    """docs/layout.md's paragraph of each top-level package names every module and subpackage in it."""
    layout = (ROOT / "docs" / "layout.md").read_text().split("## The packages", 1)[1]
    paragraphs = {p.split("`**", 1)[0].strip("*`"): p for p in layout.split("\n- **`")[1:]}
    for p in sorted((ROOT / "vitexp").iterdir()):
        if p.is_dir() and (p / "__init__.py").exists():
            assert f"{p.name}/" in paragraphs, f"docs/layout.md misses vitexp/{p.name}/"
            for child in sorted(p.iterdir()):
                if child.name in ("__init__.py", "__pycache__"):
                    continue
                name = child.name + ("/" if child.is_dir() else "")
                assert f"`{name}`" in paragraphs[f"{p.name}/"], (
                    f"docs/layout.md misses vitexp/{p.name}/{name}"
                )
        elif p.suffix == ".py" and p.name != "__init__.py":
            assert p.name in paragraphs, f"docs/layout.md misses vitexp/{p.name}"


def test_the_progress_bar_shows_accuracy_in_percent(monkeypatch):
    from lightning.pytorch.callbacks import TQDMProgressBar

    from vitexp.training.build import PercentProgressBar

    monkeypatch.setattr(
        TQDMProgressBar, "get_metrics", lambda self, t, m: {"val/top1": 0.9531, "train/loss": 0.25}
    )
    assert PercentProgressBar().get_metrics(None, None) == {"val/top1": "95.31%", "train/loss": 0.25}


def test_a_failed_validation_removes_only_folders_vitexp_made(tmp_path):
    """The empty run folder goes; above it only Hydra's outputs/<name>/ and outputs/, never a folder
    the user chose for hydra.run.dir."""
    from vitexp.runs.owner import remove_if_empty

    mine = tmp_path / "scratch" / "me" / "run1"
    (mine / ".hydra").mkdir(parents=True)
    remove_if_empty(mine)
    assert not mine.exists() and (tmp_path / "scratch" / "me").is_dir()
    hydra_made = tmp_path / "proj" / "outputs" / "demo" / "2026-01-01_00-00-00"
    (hydra_made / ".hydra").mkdir(parents=True)
    remove_if_empty(hydra_made)
    assert not (tmp_path / "proj" / "outputs").exists() and (tmp_path / "proj").is_dir()


def test_a_resumed_run_may_pin_a_newer_run_of_its_teacher_but_not_another_teacher(tmp_path):
    """Each attempt pins backbone.pretrained=run:<experiment> to that experiment's newest run: the
    fingerprint reads a pinned run id as its experiment, so a newer run of the same teacher is the
    same run, another teacher is not."""
    from vitexp.runs.owner import config_fingerprint

    (tmp_path / "runs").mkdir()
    for run_id, experiment in (("a1", "teacher"), ("a2", "teacher"), ("b1", "other")):
        (tmp_path / "runs" / f"{run_id}.json").write_text(
            json.dumps(
                {
                    "run_id": run_id,
                    "experiment": experiment,
                    "status": "completed",
                    "kind": "train",
                    "started": "2026-01-01T00:00:00+00:00",
                    "config": run_config(0),
                }
            )
        )

    def config(pin):
        return {"results_dir": str(tmp_path), "name": "x", "backbone": {"pretrained": f"run:{pin}"}}

    assert config_fingerprint(config("a1")) == config_fingerprint(config("a2"))
    assert config_fingerprint(config("a1")) != config_fingerprint(config("b1"))


def test_wandb_shows_the_ledgers_top1_in_a_group_with_tags(make_cfg, results_dir, tmp_path, monkeypatch):
    """An offline W&B run logs test/top1 in % (the ledger's value, not torchmetrics' fraction), is
    in its experiment's group and is tagged with its backbone, method and budget."""
    import wandb
    from wandb.sdk.wandb_run import Run

    from vitexp.commands.train import train

    inits, logged = [], {}
    real_init, real_log = wandb.init, Run.log
    monkeypatch.setattr(wandb, "init", lambda **kw: (inits.append(kw), real_init(**kw))[1])
    monkeypatch.setattr(
        Run, "log", lambda self, data, *a, **kw: (logged.update(data), real_log(self, data, *a, **kw))[1]
    )
    cfg = make_cfg(
        [
            "data=synthetic",
            "data.noise=0.1",
            "data.num_train=32",
            "data.num_val=16",
            "data.num_test=64",
            "recipe.batch_size=16",
            "recipe.epochs=1",
            "recipe.warmup_epochs=0",
            "eval.throughput=false",
            "eval.flops=false",
            "trainer.enable_progress_bar=false",
            "logger=wandb",
        ],
        tmp_path / "wandb_run",
    )
    result = train(cfg)
    (entry,) = ledger_entries(results_dir)
    assert entry["metrics"]["top1"] == result["metrics"]["top1"] > 1.0  # a fraction would be at most 1
    assert logged["test/top1"] == pytest.approx(entry["metrics"]["top1"])
    assert logged["val/top1"] == pytest.approx(entry["metrics"]["val_top1"])
    (init,) = inits
    assert init["group"] == "demo"
    assert {"backbone=vit_micro", "method=baseline", "budget=none"} <= set(init["tags"])


class _SignalAtEpoch:
    """A callback that sends this process ``signum`` at the start of ``epoch`` (Ctrl-C, a scheduler's
    SIGTERM)."""

    def __new__(cls, epoch: int, signum: int):
        import os

        from lightning.pytorch.callbacks import Callback

        class Send(Callback):
            def on_train_epoch_start(self, trainer, pl_module):
                if trainer.current_epoch == epoch:
                    os.kill(os.getpid(), signum)

        return Send()


class _Stopped(Exception):
    """What the test's own SIGTERM handler raises: the signal reached the handler from before the run."""


def _stop(signum, frame):
    raise _Stopped(signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_interrupts_the_entry_and_the_resumed_run_sums_its_attempts(
    make_cfg, results_dir, tmp_path, signum
):
    """SIGINT and SIGTERM close the entry ``interrupted`` with the signal (not ``failed``), then reach the
    handler that was there before the run (Python's KeyboardInterrupt for SIGINT; for SIGTERM this test's
    own handler, where a bare process would end); resume=auto continues it, and its fit_time_s is the
    sum of both attempts' (each kept under attempts)."""
    from vitexp.commands.train import train

    over = (
        [o for o in SMALL_RUN if not o.startswith(("logger", "recipe.epochs", "data.num_t"))]
        + QUIET[:1]
        + ["resume=auto", "recipe.epochs=3", "data.num_train=32", "data.num_test=16"]
    )
    cfg = make_cfg(over, tmp_path / "split")
    before = signal.signal(signal.SIGTERM, _stop) if signum == signal.SIGTERM else None
    try:
        with pytest.raises(KeyboardInterrupt if signum == signal.SIGINT else _Stopped):
            train(cfg, callbacks=[_SignalAtEpoch(1, signum)])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are restored
        assert signal.getsignal(signal.SIGTERM) is (_stop if before is not None else signal.SIG_DFL)
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
    (entry,) = ledger_entries(results_dir)
    name = signal.Signals(signum).name
    assert (
        entry["status"] == "interrupted"
        and entry["signal"] == name
        and entry["error"] == f"interrupted by {name}"
    )
    first = entry["attempt_fit_time_s"]["main"]
    assert first > 0
    resumed = train(make_cfg(over, tmp_path / "split"))
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed" and entry["attempts"][0]["status"] == "interrupted"
    assert entry["attempts"][0]["fit_time_s"] == {"main": first}
    assert resumed["metrics"]["fit_time_s"] == pytest.approx(first + entry["attempt_fit_time_s"]["main"])


@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_signal_to_pytest_ends_the_session_and_the_run_is_interrupted(tmp_path, signum):
    """A pytest session training a model in-process (tests/interrupt_target.py) stops within seconds of
    SIGINT (pytest's "interrupted" banner, exit 2) or SIGTERM (the process ended by the signal), the
    run's entry closed ``interrupted``, and the session's next test never starts. (Python's teardown
    after the banner, a garbage collection of torch's objects, is not timed: seconds on a quiet machine.)"""
    base = tmp_path / "pytest"
    env = {**cli_env(tmp_path / "unused"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            str(ROOT / "tests" / "interrupt_target.py"),
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-q",
            "-o",
            "addopts=",
            f"--basetemp={base}",
            "--rootdir",
            str(ROOT / "tests"),
        ],
        cwd=ROOT / "tests",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not list(base.glob("test_train_until_interrupted0/run/checkpoints/*.ckpt")):  # one epoch done
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the target test never started training"
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signum)
        lines = []
        if signum == signal.SIGINT:
            for line in proc.stdout:  # pytest's banner: the session stopped
                lines.append(line)
                if "KeyboardInterrupt" in line:
                    break
        took = time.monotonic() - sent
        out = "".join(lines) + proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert took < 15, f"the session went on {took:.1f} s after {signal.Signals(signum).name}"
    assert proc.returncode == (2 if signum == signal.SIGINT else -signum), out[-3000:]
    (entry,) = ledger_entries(base / "test_train_until_interrupted0" / "results")
    assert entry["status"] == "interrupted" and entry["signal"] == signal.Signals(signum).name
    assert not (base / "marker_second_test_ran").exists()


def test_an_attempt_killed_without_closing_its_entry_is_closed_interrupted_on_resume(results_dir):
    from vitexp.ledger import LedgerEntry

    entry = LedgerEntry("demo", "train", run_config(0), results_dir).start()
    entry.fitting("main", 12.5)
    entry.beat()  # then SIGKILL: the entry stays running
    again = LedgerEntry.load(entry.run_id, results_dir).reopen(run_config(0))
    (attempt,) = again.record["attempts"]
    assert attempt["status"] == "interrupted" and "killed" in attempt["error"]
    assert attempt["fit_time_s"] == {"main": 12.5} and attempt["finished"] == entry.record["heartbeat"]
    assert again.previous_fit_time() == {"main": 12.5}


def test_a_run_folder_is_owned_by_one_live_process(tmp_path):
    """The lock is the kernel's: another live process holding it is refused by name; a process
    killed with SIGKILL leaves the file behind but not the lock, so the folder is free at once."""
    import signal

    from vitexp.errors import ConfigError
    from vitexp.runs.lock import RunFolderLock

    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from vitexp.runs.lock import RunFolderLock; "
                f"RunFolderLock({str(folder)!r}).acquire(); print('held', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"in use by process {holder.pid}"):
            RunFolderLock(folder).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert (folder / "run.lock").exists()  # the file stays; its lock died with its process
        mine = RunFolderLock(folder).acquire()
        assert json.loads((folder / "run.lock").read_text())["pid"] == __import__("os").getpid()
        assert (
            RunFolderLock(folder).acquire().held is False
        )  # this process's own: re-entered, not taken twice
        mine.release()
        RunFolderLock(folder).acquire().release()
    finally:
        holder.kill()
        holder.wait()


def test_a_folder_that_holds_a_completed_run_is_not_run_again(make_cfg, results_dir, tmp_path):
    """resume=auto on a folder whose run completed would open a second entry that resumes from the
    first's last checkpoint (a duplicate "completed" with no training): refused, one entry remains."""
    from vitexp.commands.train import train
    from vitexp.errors import ConfigError

    over = [*SMALL_RUN, *QUIET, "resume=auto", "recipe.epochs=2"]
    train(make_cfg(over, tmp_path / "done"))
    with pytest.raises(ConfigError, match="holds the completed run"):
        train(make_cfg(over, tmp_path / "done"))
    (entry,) = ledger_entries(results_dir)
    assert entry["status"] == "completed"


def test_two_identical_commands_on_one_folder_never_share_a_run(tmp_path):
    """Two identical vitexp-train commands started together on the same run folder (as two started
    in the same second share Hydra's default one) with resume=auto: two completed entries, or one
    completed and one refused with exit 2 (the folder in use, or, when the first finished before the
    second looked, holding a completed run); never both exiting 0 on one entry."""
    results = tmp_path / "results"
    cmd = [
        *train_cmd(
            tmp_path / "same",
            "logger=none",
            "recipe.epochs=2",
            "data.num_train=32",
            "data.num_val=16",
            "data.num_test=16",
        )
    ]
    procs = [
        subprocess.Popen(cmd, env=cli_env(results), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    completed = [e for e in ledger_entries(results) if e["status"] == "completed"]
    assert codes in ([0, 0], [0, 2]), [o[1][-2000:] for o in outs]
    assert len(completed) == (2 if codes == [0, 0] else 1) and len(ledger_entries(results)) == len(completed)
    if codes == [0, 2]:
        refused = next(last_json(o[0]) for p, o in zip(procs, outs) if p.returncode == 2)
        assert refused["status"] == "invalid" and (
            "is in use by process" in refused["error"] or "holds the completed run" in refused["error"]
        )


def test_a_run_folder_outside_the_repository_leaves_no_absolute_path(make_cfg, results_dir, tmp_path, capsys):
    """Neither the entry nor the closing line holds an absolute path of this machine: the run folder
    (outside the repository and the results root), the ledger field, an error's text."""
    from vitexp import PROJECT_ROOT
    from vitexp.commands.inspect import run_flops
    from vitexp.ledger import LedgerEntry

    elsewhere = tmp_path / "scratch" / "me" / "run1"
    run_flops(make_cfg(["experiment=demo", "logger=csv"], output_dir=elsewhere))
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    failed = LedgerEntry(
        "demo", "train", run_config(), results_dir
    ).start()  # closed as Run._fail closes it: with its folder
    failed.fail(
        FileNotFoundError(f"[Errno 2] No such file or directory: '{elsewhere}/weights.pth'"),
        output_dir=elsewhere,
    )
    texts = [closing] + [p.read_text() for p in (results_dir / "runs").glob("*.json")]
    for text in texts:
        assert str(tmp_path) not in text and str(PROJECT_ROOT) not in text, text[:2000]
    entry = json.loads(next(t for t in texts[1:] if '"flops"' in t))
    assert entry["output_dir"] == "../scratch/me/run1" and json.loads(closing)["ledger"].startswith("runs/")
    assert "'../scratch/me/run1/weights.pth'" in failed.record["error"]


def test_two_runs_started_in_the_same_second_get_folders_of_their_own():
    """Issue 58: outside SLURM the default run folder is the start time and six random hex digits, so
    two processes started in the same second (a shell loop with &) never share one."""
    import subprocess
    import sys

    code = "from vitexp.config.composition import run_stamp; print(run_stamp())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    stamps = [p.communicate()[0].strip() for p in procs]
    assert stamps[0] != stamps[1] and all(len(s) == len("2026-12-07_21-00-00-abcdef") for s in stamps)


def test_a_refused_lock_names_its_owner_even_while_the_owner_is_writing_itself(tmp_path):
    """Issue 58: the owner writes its name just after it takes the lock; a process refused in between
    waits for it instead of naming process '?'."""
    import fcntl
    import json
    import threading
    import time

    from vitexp.errors import ConfigError
    from vitexp.runs.lock import LOCK_NAME, RunFolderLock

    path = tmp_path / LOCK_NAME
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # taken, owner not yet written

    def write_owner():
        time.sleep(0.3)
        os.pwrite(fd, json.dumps({"host": "node7", "pid": 4242, "since": "now"}).encode(), 0)

    threading.Thread(target=write_owner).start()
    with pytest.raises(ConfigError, match="in use by process 4242 on node7"):
        RunFolderLock(tmp_path).acquire()
    os.close(fd)
