"""Kept weights (vitexp.ledger.kept): a shared start's weights stored with the results, so its seeded
rows go on from the same start after the run folder is gone, and a copy whose bytes changed is
refused instead of loaded."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import QUIET, TINY_TRAIN, run_config

from vitexp.ledger import (
    KeptWeightsError,
    Ledger,
    LedgerEntry,
    keep,
    kept_path,
    sha256,
    weights_file,
    weights_run,
)

SPEC = {
    "name": "s",
    "seeds": [0],
    "rows": [
        {"label": "pre", "experiment": "demo", "seeds": None},
        {"label": "ft", "experiment": "chunk_demo"},
    ],
}


def _start(results_dir, tmp_path, record_hash=True, state=None):
    """A completed run of the shared start ``demo`` whose weights (over 1 MiB: a hash of the first
    block alone would not do) lie in a run folder outside results."""
    weights = tmp_path / "outputs" / "demo" / "weights.pth"
    weights.parent.mkdir(parents=True)
    torch.save(state or {"w": torch.arange(6.0), "pad": torch.zeros(300_000)}, weights)
    artifacts = {"weights": str(weights), **({"weights_sha256": sha256(weights)} if record_hash else {})}
    entry = LedgerEntry("demo", "train", run_config(0), results_dir).start()
    entry.finish({"top1": 1.0}, artifacts=artifacts)
    return entry.record, weights


def test_a_kept_start_outlives_its_run_folder_and_the_sweep_goes_on_from_it(results_dir, tmp_path):
    from vitexp.commands.sweep import keep_starts, plan

    run, weights = _start(results_dir, tmp_path)
    kept = keep_starts(SPEC, results_dir)["demo"]
    assert kept["copied"] and kept["sha256"] == sha256(weights) and kept["bytes"] == weights.stat().st_size
    assert kept_path(run["run_id"], results_dir).read_bytes() == weights.read_bytes()
    assert keep_starts(SPEC, results_dir)["demo"]["copied"] is False  # already kept: left as it is
    weights.unlink()  # the run folder is gone (a new machine, a cleaned scratch disk)
    found = weights_run("run:demo", results_dir)
    assert found["run_id"] == run["run_id"] and weights_file(found, results_dir) == kept_path(
        run["run_id"], results_dir
    )
    assert torch.equal(
        torch.load(weights_file(found, results_dir), weights_only=True)["w"], torch.arange(6.0)
    )
    todo = plan(SPEC, None, False, results_dir)["train"]
    assert todo["skip"] == ["demo"] and todo["launch"] == [
        "chunk_demo+seed=0"
    ]  # the start does not train again


def test_a_kept_copy_whose_bytes_changed_is_refused_naming_both_hashes(results_dir, tmp_path):
    from vitexp.commands.sweep import plan

    run, weights = _start(results_dir, tmp_path)
    keep(run, results_dir)
    weights.unlink()
    copy = kept_path(run["run_id"], results_dir)
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1  # one bit flipped in the last block
    copy.write_bytes(bytes(data))
    with pytest.raises(
        KeptWeightsError, match=f"{sha256(copy)[:12]}, not the {run['artifacts']['weights_sha256'][:12]}"
    ):
        weights_file(run, results_dir)
    copy.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")  # an LFS pointer
    with pytest.raises(
        KeptWeightsError,
        match=(
            f"backbone.pretrained=run:demo: .*{sha256(copy)[:12]}, not the "
            f"{run['artifacts']['weights_sha256'][:12]}"
        ),
    ):
        weights_run("run:demo", results_dir)
    # the sweep stops there, naming the start, instead of training it and its seeded rows again
    with pytest.raises(ValueError, match="the shared start demo: .*git-lfs|the shared start demo: .*sha256"):
        plan(SPEC, None, False, results_dir)


def test_a_kept_record_of_another_run_is_refused_and_a_wrong_record_is_kept_again(results_dir, tmp_path):
    run, weights = _start(results_dir, tmp_path)
    kept = keep(run, results_dir)
    record = kept_path(run["run_id"], results_dir).with_suffix(".json")
    record.write_text(json.dumps({**json.loads(record.read_text()), "run_id": "another"}))
    weights.rename(weights.with_name("away.pth"))
    with pytest.raises(KeptWeightsError, match="records run another"):
        weights_file(run, results_dir)
    weights.with_name("away.pth").rename(weights)
    assert keep(run, results_dir)["copied"] is True  # the wrong record is written again
    assert json.loads(record.read_text())["run_id"] == run["run_id"] and kept["sha256"] == sha256(weights)
    weights.unlink()  # the run folder gone, a valid copy kept: keeping it again is not an error
    assert keep(run, results_dir)["copied"] is False


def test_a_run_folders_file_changed_after_the_run_is_not_read(results_dir, tmp_path):
    run, weights = _start(results_dir, tmp_path)
    torch.save({"w": torch.zeros(6)}, weights)  # overwritten after the run recorded its hash
    with pytest.raises(KeptWeightsError, match="changed after the run"):
        weights_file(run, results_dir)
    torch.save({"w": torch.arange(6.0), "pad": torch.zeros(300_000)}, weights)  # the same bytes again
    keep(run, results_dir)
    torch.save({"w": torch.zeros(6)}, weights)
    assert weights_file(run, results_dir) == kept_path(run["run_id"], results_dir)  # the kept copy stands in


def test_a_seeded_row_is_built_from_the_kept_start(results_dir, tmp_path, make_cfg):
    """Validation pins run:demo to the start's run and the model loads the kept copy's tensors."""
    from vitexp.training.build import build_configured_backbone
    from vitexp.training.resolve import validate

    cfg = make_cfg(["backbone=vit_micro", "data=synthetic", "logger=none"])
    state = {k: torch.randn_like(v) for k, v in build_configured_backbone(cfg).state_dict().items()}
    run, weights = _start(results_dir, tmp_path, state=state)
    keep(run, results_dir)
    weights.unlink()
    cfg = make_cfg(["backbone=vit_micro", "data=synthetic", "logger=none", "backbone.pretrained=run:demo"])
    validate(cfg, need_data=False)
    assert cfg.backbone.pretrained == f"run:{run['run_id']}"
    loaded = build_configured_backbone(cfg).state_dict()
    assert torch.equal(loaded["blocks.0.attn.qkv.weight"], state["blocks.0.attn.qkv.weight"])


def test_a_sweep_that_trained_keeps_its_start(results_dir, tmp_path, monkeypatch, capsys):
    """The sweep's training (faked: it writes the start's run) is followed by keeping the start."""
    import subprocess

    import vitexp.commands.sweep

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "title: t\nseeds: [0]\ncolumns: [{key: top1, label: T}]\n"
        "rows: [{label: pre, experiment: demo, seeds: null}]\n"
    )
    made = {}

    def fake_run(cmd, *a, **k):
        made["run"], _ = _start(results_dir, tmp_path)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(vitexp.commands.sweep.subprocess, "run", fake_run)
    assert vitexp.commands.sweep.main([str(spec), f"results_dir={results_dir}"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["kept"]["demo"]["copied"] and line["kept"]["demo"]["run_id"] == made["run"]["run_id"]
    assert kept_path(made["run"]["run_id"], results_dir).is_file()


def test_weights_changed_after_their_run_are_not_kept(results_dir, tmp_path):
    run, weights = _start(results_dir, tmp_path)
    torch.save({"w": torch.zeros(6)}, weights)  # overwritten after the run recorded its hash
    with pytest.raises(KeptWeightsError, match="changed after the run"):
        keep(run, results_dir)
    assert not kept_path(run["run_id"], results_dir).exists()


def test_keep_starts_says_which_start_has_no_weights_here_and_fails(results_dir, tmp_path, capsys):
    from vitexp.commands.sweep import main

    run, weights = _start(results_dir, tmp_path, record_hash=False)
    weights.unlink()
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "title: t\nseeds: [0]\ncolumns: [{key: top1, label: T}]\n"
        "rows: [{label: pre, experiment: demo, seeds: null}, {label: ft, experiment: chunk_demo}]\n"
    )
    assert main([str(spec), "--keep-starts", f"results_dir={results_dir}"]) == 1
    out = capsys.readouterr()
    line = json.loads(out.out.strip().splitlines()[-1])
    assert line["status"] == "failed" and "not on this machine" in line["kept"]["demo"]["error"]
    assert f"demo: not kept: run {run['run_id']}" in out.err


def test_a_train_run_records_the_sha256_of_the_weights_it_saved(make_cfg, results_dir):
    from vitexp.commands.train import train

    train(make_cfg([*QUIET, *TINY_TRAIN]))  # the demo's experiment (digits model) on synthetic images
    (run,) = [r for r in Ledger.load(results_dir) if r["kind"] == "train"]
    assert run["artifacts"]["weights_sha256"] == sha256(weights_file(run, results_dir))
