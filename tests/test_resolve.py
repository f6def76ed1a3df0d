"""The one resolve step (vitexp/training/resolve.py): a command checks and resolves its config once, at
its top, before its run starts; the run's lifecycle (vitexp/training/fit.py) checks nothing again."""

from __future__ import annotations

import json

import pytest
from conftest import QUIET

TINY = [
    *QUIET,
    "recipe.epochs=1",
    "recipe.warmup_epochs=0",
    "trainer.limit_train_batches=1",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "eval.flops=false",
    "eval.throughput=false",
]


@pytest.fixture
def checks(monkeypatch, results_dir):
    """The names of the configs checked, in order (every check goes through resolve._checked)."""
    from vitexp.training import resolve

    monkeypatch.setenv("VITEXP_RESULTS", str(results_dir))
    calls: list[str] = []
    real = resolve._checked

    def spy(cfg, *args, **kwargs):
        calls.append(str(cfg.name))
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(resolve, "_checked", spy)
    return calls


def test_a_training_run_checks_its_config_once(checks, make_cfg):
    from vitexp.commands.train import train

    result = train(make_cfg(TINY))
    assert result["metrics"]["epochs"] == 1
    assert checks == ["demo"]


def test_the_fit_takes_resolved_parts_and_checks_nothing(checks, make_cfg):
    from vitexp.training.fit import fit_run
    from vitexp.training.resolve import resolve

    resolved = resolve(make_cfg(TINY), runs=True)
    assert checks == ["demo"]
    fit_run(resolved)
    assert checks == ["demo"]


def test_a_flops_count_checks_its_config_once(checks, make_cfg):
    from vitexp.commands.inspect import run_flops

    result = run_flops(make_cfg([*QUIET, "method=bspf", "budget=keep_ratio"]))
    assert result["metrics"]["gmacs"] > 0
    assert checks == ["demo"]


def test_the_fit_builds_from_the_resolved_weights_and_resolves_nothing_again(
    make_cfg, tmp_path, monkeypatch, results_dir
):
    """A ``backbone.pretrained`` file is found once, by the resolve step; the fit builds the backbone
    from that file and never resolves ``backbone.pretrained`` again."""
    import torch
    from omegaconf import open_dict

    from vitexp.config import weights as weight_tags
    from vitexp.training.build import build_configured_backbone
    from vitexp.training.fit import fit_run
    from vitexp.training.resolve import resolve

    monkeypatch.setenv("VITEXP_RESULTS", str(results_dir))
    cfg = make_cfg(TINY)
    start = tmp_path / "start.pth"
    torch.save(build_configured_backbone(cfg).state_dict(), start)
    with open_dict(cfg):
        cfg.backbone.pretrained = str(start)
    resolved = resolve(cfg)
    assert resolved.weights == str(start)

    def again(*args, **kwargs):
        raise AssertionError("backbone.pretrained resolved again inside the run")

    monkeypatch.setattr(weight_tags, "resolve_weights", again)
    result = fit_run(resolved)
    entry = json.loads((results_dir / result["ledger"]).read_text())
    assert entry["artifacts"]["pretrained"]["file"].endswith("start.pth")


def test_the_raptor_audit_resolves_its_models_before_its_run_starts(checks, results_dir, monkeypatch):
    """vitexp-audit raptor composes and checks each model's config at the command's top: every check
    happens before the audit's ledger entry is opened, none inside the run."""
    import argparse

    from vitexp.commands import inspect
    from vitexp.runs import owner

    opened: list[int] = []
    real = owner.owned_run

    def spy(*args, **kwargs):
        opened.append(len(checks))  # how many configs had been checked when the run began
        return real(*args, **kwargs)

    monkeypatch.setattr(inspect, "owned_run", spy)
    inspect.run_audit(argparse.Namespace(paper="raptor", sizes=["s"]), results_dir)
    assert opened == [len(checks)] and len(checks) == 6  # six models, all checked before the run
