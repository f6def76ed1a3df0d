"""vitexp-eval: the model a run saved, rebuilt and tested, gives the ledger's top-1."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import QUIET, ledger_entries

ROOT = Path(__file__).resolve().parent.parent
TINY = QUIET + [
    "data=synthetic",
    "data.num_train=32",
    "data.num_val=16",
    "data.num_test=32",
    "recipe.batch_size=16",
    "recipe.epochs=2",
    "recipe.warmup_epochs=0",
    "eval.throughput=false",
    "eval.flops=false",
]


def run_eval(capsys, *argv: str) -> dict:
    from vitexp.commands.cli import eval_main

    capsys.readouterr()
    eval_main(list(argv))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["saper_ft", "saper_kd"])
def test_eval_reproduces_a_saper_micro_runs_top1(method, make_cfg, results_dir, tmp_path, capsys):
    from vitexp.commands.train import train

    trained = train(
        make_cfg(
            TINY
            + ["backbone=dinov2_micro", f"method={method}", "budget=heads", "budget.k=5", "recipe.lr=0.01"],
            tmp_path / method,
        )
    )
    result = run_eval(capsys, trained["run_id"], "logger=none", "trainer.enable_progress_bar=false")
    assert result["status"] == "completed" and result["evaluates"] == trained["run_id"]
    assert result["metrics"]["top1"] == pytest.approx(trained["metrics"]["top1"], abs=1e-9)
    if trained["metrics"]["test_loss"] is None:  # saper_kd: the deployed k-NN model has no distillation loss
        assert result["metrics"]["test_loss"] is None and trained["metrics"]["soft_test_loss"] is not None
    else:
        assert result["metrics"]["test_loss"] == pytest.approx(trained["metrics"]["test_loss"], rel=1e-5)
    kinds = sorted(e["kind"] for e in ledger_entries(results_dir))
    assert kinds == ["eval", "train"]


def test_eval_takes_a_lightning_checkpoint_and_refuses_unknown_keys(
    make_cfg, results_dir, tmp_path, capsys, trained_run
):
    """``--weights <run>/checkpoints/last.ckpt`` (the ``model.`` prefix removed) and
    ``backbone.pretrained=<last.ckpt>`` load the trained weights; a misspelt key is refused."""
    from vitexp.training.build import build_configured_backbone

    trained = trained_run(TINY)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["last.ckpt"]  # one file, replaced every epoch
    result = run_eval(capsys, "demo", "logger=none", "--weights", str(ckpt))
    assert result["metrics"]["top1"] == pytest.approx(trained["metrics"]["top1"], abs=1e-9)
    import torch

    saved = torch.load(tmp_path / "run" / "weights.pth", weights_only=True)
    model = build_configured_backbone(make_cfg(TINY + [f"backbone.pretrained={ckpt}"]))
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    with pytest.raises(SystemExit) as exit_:
        run_eval(capsys, "demo", "recipe.lrr=1")
    assert exit_.value.code == 2


@pytest.mark.slow
def test_eval_reproduces_the_committed_demo_run(make_cfg, results_dir, tmp_path, capsys):
    """The committed demo run's weights are not in the repository: the demo is trained again
    (same seed, same data) and must give the committed top-1, then vitexp-eval the same."""
    from vitexp.commands.train import train
    from vitexp.ledger import Ledger

    committed = Ledger.load(ROOT / "results").newest("demo")  # the run the demo table cites
    trained = train(make_cfg(QUIET + ["eval.throughput=false"], tmp_path / "demo"))
    assert trained["metrics"]["top1"] == pytest.approx(committed["metrics"]["top1"], abs=1e-6)
    result = run_eval(capsys, "demo", "logger=none")
    assert result["metrics"]["top1"] == pytest.approx(committed["metrics"]["top1"], abs=1e-6)


def test_eval_reads_the_runs_portable_paths_as_paths_on_this_machine(make_cfg, results_dir):
    """The ledger stores data.root and backbone.pretrained relative to the project or the results
    folder; the evaluation gets them back as paths on this machine."""
    from vitexp.commands.evaluate import eval_config
    from vitexp.config.composition import to_container
    from vitexp.ledger import LedgerEntry

    weights = results_dir / "outputs" / "teacher" / "weights.pth"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"")
    config = to_container(
        make_cfg(["data=micro_coco", f"backbone.pretrained={weights}"], results_dir / "outputs" / "r")
    )
    entry = LedgerEntry("demo", "train", config, results_dir).start()
    entry.finish({"top1": 1.0})
    stored = json.loads(entry.path.read_text())["config"]
    assert (stored["data"]["root"], stored["backbone"]["pretrained"]) == (
        "data/micro_coco",
        "outputs/teacher/weights.pth",
    )
    cfg, _ = eval_config(entry.run_id)
    assert cfg.data.root == str(ROOT / "data" / "micro_coco") and cfg.backbone.pretrained == str(weights)


def test_a_run_is_evaluated_from_its_wandb_model_artifact_elsewhere(
    make_cfg, results_dir, tmp_path, capsys, monkeypatch
):
    """A run logged to W&B (offline here) logs its deployed weights as a model artifact, which its
    offline run keeps for ``wandb sync``, and its ledger entry names it. ``vitexp-eval <artifact>``
    on a machine with neither the run's entry nor its weights (W&B's API stubbed with what the run
    logged) rebuilds the model from the record the artifact carries and gives the run's top-1."""
    import shutil
    from types import SimpleNamespace

    import wandb
    from wandb.sdk.wandb_run import Run

    from vitexp.commands.train import train
    from vitexp.ledger import local_path

    logged = {}
    real_log_artifact = Run.log_artifact
    monkeypatch.setattr(
        Run,
        "log_artifact",
        lambda self, artifact, *a, **kw: (
            logged.update({artifact.name: artifact}),
            real_log_artifact(self, artifact, *a, **kw),
        )[1],
    )
    trained = train(make_cfg(TINY + ["logger=wandb"], tmp_path / "run"))
    (entry,) = ledger_entries(results_dir)
    reference = entry["artifacts"]["wandb_model"]
    name = f"weights-{trained['run_id']}"
    assert reference == f"vitexp/{name}:latest"  # offline: no entity until synced
    artifact = logged[name]
    assert artifact.type == "model" and list(artifact.manifest.entries) == ["weights.pth"]
    assert (
        artifact.metadata["run_id"] == trained["run_id"]
        and artifact.metadata["metrics"]["top1"] == trained["metrics"]["top1"]
    )
    offline_run = local_path(entry["wandb_url"].removeprefix("offline:"), results_dir).parent
    # kept for wandb sync; W&B's service process may still be writing the file after finish() returns
    deadline = time.monotonic() + 60
    while (
        name.encode() not in next(offline_run.glob("run-*.wandb")).read_bytes()
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert name.encode() in next(offline_run.glob("run-*.wandb")).read_bytes()

    weights = tmp_path / "downloaded.pth"
    shutil.copy(tmp_path / "run" / "weights.pth", weights)
    shutil.rmtree(tmp_path / "run")
    monkeypatch.setenv("VITEXP_RESULTS", str(tmp_path / "elsewhere"))

    def download(root):
        Path(root).mkdir(parents=True)
        shutil.copy(weights, Path(root) / "weights.pth")
        return root

    stored = SimpleNamespace(name=f"{name}:v0", metadata=artifact.metadata, download=download)
    monkeypatch.setattr(
        wandb,
        "Api",
        lambda: SimpleNamespace(
            artifact=lambda ref, type=None: stored if ref == reference else pytest.fail(f"asked for {ref}")
        ),
    )
    result = run_eval(capsys, reference, "logger=none", "trainer.enable_progress_bar=false")
    assert result["status"] == "completed" and result["evaluates"] == trained["run_id"]
    assert result["metrics"]["top1"] == pytest.approx(trained["metrics"]["top1"], abs=1e-9)
    assert [e["kind"] for e in ledger_entries(tmp_path / "elsewhere")] == ["eval"]


def test_bad_weights_are_refused_before_the_eval_entry(results_dir, tmp_path, capsys, trained_run):
    """--weights that are empty, random bytes or another model's: exit 2, one line naming the file,
    no eval entry (the training run's entry is the only one)."""
    import os

    import torch

    trained_run(TINY)
    bad = {"empty": b"", "random": os.urandom(2048)}
    for name, content in bad.items():
        (tmp_path / f"{name}.pth").write_bytes(content)
    torch.save({"foo.weight": torch.zeros(2)}, tmp_path / "other.pth")
    for name in (*bad, "other"):
        file = tmp_path / f"{name}.pth"
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            run_eval(capsys, "demo", "logger=none", "--weights", str(file))
        out = capsys.readouterr()
        (line,) = out.err.splitlines()
        assert exit_.value.code == 2 and str(file) in line and "weights_only=False" not in line
        assert json.loads(out.out.strip().splitlines()[-1])["status"] == "invalid"
        assert [e["kind"] for e in ledger_entries(results_dir)] == ["train"]


STUDENTS = {
    "fine-tuned": [],  # RAPTOR: its phases chosen from the teacher's weights, on data
    "raptor": [
        "experiment=raptor_micro",
        "data=synthetic",
        "recipe.epochs=1",
        "method.probe.epochs=1",
        "method.phase_images=16",
        "method.teacher_probe=false",
    ],
}


@pytest.mark.parametrize("student_kind", list(STUDENTS))
def test_eval_of_a_run_fine_tuned_from_a_teacher_needs_not_the_teachers_weights(
    student_kind, make_cfg, results_dir, tmp_path, capsys, trained_run
):
    """A student trained from ``backbone.pretrained=run:<teacher>`` is evaluated from its own
    weights alone: with the teacher's ledger entry and run folder gone (a machine that did not
    train the teacher), ``vitexp-eval <student>`` reproduces the student's top-1."""
    import shutil

    from vitexp.commands.train import train

    backbone = ["backbone=dinov2_micro_reg"] if student_kind == "raptor" else []
    teacher = trained_run(TINY + backbone + ["name=teacher"], "teacher")
    student = train(
        make_cfg(
            TINY
            + backbone
            + STUDENTS[student_kind]
            + ["name=student", f"backbone.pretrained=run:{teacher['run_id']}"],
            tmp_path / "student",
        )
    )
    (results_dir / "runs" / f"{teacher['run_id']}.json").unlink()
    shutil.rmtree(tmp_path / "teacher")
    result = run_eval(capsys, student["run_id"], "logger=none")
    assert result["status"] == "completed" and result["evaluates"] == student["run_id"]
    assert result["metrics"]["top1"] == pytest.approx(student["metrics"]["top1"], abs=1e-9)


def test_missing_weights_are_an_invalid_command_in_one_line(results_dir, tmp_path, capsys, trained_run):
    """``--weights`` naming no file, and a run whose own weights.pth is gone (no W&B artifact to
    take it from): exit 2, one line naming the file, no eval entry."""
    trained = trained_run(TINY)
    missing = tmp_path / "nonexistent.pth"
    own = tmp_path / "run" / "weights.pth"
    for args, named in ((["--weights", str(missing)], str(missing)), ([], "weights.pth")):
        if not args:
            own.unlink()
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            run_eval(capsys, trained["run_id"], "logger=none", *args)
        out = capsys.readouterr()
        (line,) = out.err.splitlines()
        assert exit_.value.code == 2 and named in line and "vitexp-eval: invalid" in line, line
        assert json.loads(out.out.strip().splitlines()[-1])["status"] == "invalid"
        assert [e["kind"] for e in ledger_entries(results_dir)] == ["train"]


def test_a_config_recorded_before_the_package_layout_names_classes_that_still_import():
    """Entries recorded before the layout of docs/layout.md name ``vitexp.data.<Class>`` and
    ``vitexp.fashion_mnist.<Class>``; vitexp-eval reads them where the classes lie today."""
    import importlib

    from vitexp.config.composition import with_moved_targets

    old = {
        "data": {"_target_": "vitexp.fashion_mnist.FashionMNISTDataModule"},
        "other": [{"_target_": "vitexp.data.DigitsDataModule"}],
        "method": {"_target_": "vitexp.methods.bspf.BSPF"},
        "today": {"_target_": "vitexp.data.datamodules.DigitsDataModule"},
    }
    new = with_moved_targets(old)
    targets = [
        new["data"]["_target_"],
        new["other"][0]["_target_"],
        new["method"]["_target_"],
        new["today"]["_target_"],
    ]
    assert targets == [
        "vitexp.data.fashion_mnist.FashionMNISTDataModule",
        "vitexp.data.datamodules.DigitsDataModule",
        "vitexp.methods.bspf.BSPF",
        "vitexp.data.datamodules.DigitsDataModule",
    ]
    for target in targets:
        module, _, name = target.rpartition(".")
        assert hasattr(importlib.import_module(module), name)
