"""The ledger: atomic writes, concurrent writers, finished entries never overwritten."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest
from conftest import run_config
from ledger_records import completed_runs, iter_runs

from vitexp.ledger import LedgerEntry, atomic_write_json


def test_entry_lifecycle_and_schema(results_dir):
    entry = LedgerEntry("demo", "train", run_config(top={"a": 1}), results_dir).start()
    on_disk = json.loads(entry.path.read_text())
    assert on_disk["status"] == "running"
    path = entry.finish({"top1": 90.0}, {"unit": "GMACs"}, wandb_url=None)
    record = json.loads(path.read_text())
    for key in (
        "run_id",
        "experiment",
        "status",
        "kind",
        "config",
        "metrics",
        "protocol",
        "env",
        "wandb_url",
        "started",
        "finished",
        "error",
    ):
        assert key in record
    assert record["status"] == "completed" and record["metrics"]["top1"] == 90.0
    assert record["env"]["packages"]["torch"]
    import torch

    from vitexp.ledger.entry import (
        cpu_model,
    )  # the machine is recorded: one-thread runs repeat only on one machine

    assert record["env"]["cpu"] == {
        "model": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }
    assert record["env"]["cpu"]["model"] and record["env"]["cpu"]["capability"]
    with pytest.raises(RuntimeError, match="already completed"):
        entry.fail(ValueError("late"))
    assert json.loads(path.read_text())["status"] == "completed"


def test_failed_entry_records_the_error(results_dir):
    entry = LedgerEntry("demo", "train", run_config(), results_dir).start()
    entry.fail(FloatingPointError("loss is nan"))
    record = json.loads(entry.path.read_text())
    assert record["status"] == "failed" and "loss is nan" in record["error"]
    assert completed_runs(results_dir=results_dir) == []


def test_atomic_write_keeps_the_old_file_when_serialisation_fails(tmp_path):
    target = tmp_path / "runs" / "x.json"
    atomic_write_json(target, {"ok": 1})

    class Boom:
        def __str__(self):
            raise RuntimeError("cannot serialise")

    with pytest.raises(RuntimeError):
        atomic_write_json(target, {"bad": Boom()})
    assert json.loads(target.read_text()) == {"ok": 1}
    assert [p.name for p in target.parent.iterdir()] == ["x.json"], "no temporary file left behind"


def _writer(args):
    results_dir, i = args
    entry = LedgerEntry(f"exp{i % 3}", "train", run_config(top={"i": i}), results_dir).start()
    entry.finish({"top1": float(i)})
    return entry.run_id


def test_concurrent_writers_all_land(results_dir):
    n = 16
    with mp.get_context("spawn").Pool(4) as pool:
        ids = pool.map(_writer, [(str(results_dir), i) for i in range(n)])
    assert len(set(ids)) == n
    records = list(iter_runs(results_dir))
    assert len(records) == n and all(r["status"] == "completed" for r in records)
    assert sorted(r["metrics"]["top1"] for r in records) == [float(i) for i in range(n)]
    assert not [p for p in os.listdir(results_dir / "runs") if p.endswith(".tmp")]


def test_a_broken_file_is_an_error_that_names_it_never_skipped(results_dir):
    """A file that does not parse (a truncated copy) or breaks the schema is kept aside with what is
    wrong, and a whole-ledger read raises naming it (it used to be skipped in silence)."""
    from vitexp.ledger import Ledger, LedgerError

    (results_dir / "runs").mkdir(parents=True)
    (results_dir / "runs" / "broken.json").write_text("{not json")
    (results_dir / "runs" / "wrong.json").write_text(
        json.dumps(
            {
                "run_id": "wrong",
                "experiment": "demo",
                "status": "done",
                "kind": "train",
                "started": "2026-01-01T00:00:00+00:00",
            }
        )
    )
    LedgerEntry("demo", "flops", {}, results_dir).start().finish({"gmacs": 1.0})
    ledger = Ledger.load(results_dir)
    assert [r["experiment"] for r in ledger] == ["demo"]
    assert {b.path: b.problem for b in ledger.broken} == {
        "runs/broken.json": (
            "not JSON (Expecting property name enclosed in double quotes at line 1, column 2: "
            "a truncated copy or a merge conflict?)"
        ),
        "runs/wrong.json": (
            "status 'done' is not one of ['running', 'completed', 'failed', 'interrupted']; no 'config'"
        ),
    }
    with pytest.raises(
        LedgerError, match="2 broken ledger entries.*runs/broken.json: not JSON.*runs/wrong.json"
    ):
        list(iter_runs(results_dir))
    # wrong.json says it is demo's; broken.json could be anyone's; a truncated run file names its experiment
    (results_dir / "runs" / "20260101-000000-train-fmnist_x-seed-1-abc123.json").write_text(
        '{"run_id": "2026'
    )
    ledger = Ledger.load(results_dir)
    assert [b.path for b in ledger.broken_for(["other"])] == ["runs/broken.json"]
    assert [b.path for b in ledger.broken_for(["demo+seed=1"])] == ["runs/broken.json", "runs/wrong.json"]
    assert [b.path for b in ledger.broken_for(["fmnist_x"])] == [
        "runs/20260101-000000-train-fmnist_x-seed-1-abc123.json",
        "runs/broken.json",
    ]


def _strings(value):
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_no_entry_holds_an_absolute_path_of_this_machine(make_cfg, results_dir, tmp_path):
    """A flops run whose config holds paths inside the project (data.root) and the results folder
    (results_dir, output_dir): none of them is stored absolute, at any depth of the entry."""
    from vitexp import PROJECT_ROOT
    from vitexp.commands.inspect import run_flops
    from vitexp.ledger import local_path

    cfg = make_cfg(["data=micro_coco", "logger=csv"], output_dir=results_dir / "outputs" / "f1")
    assert str(cfg.data.root).startswith(str(PROJECT_ROOT))
    run_flops(cfg)
    (entry,) = [json.loads(p.read_text()) for p in (results_dir / "runs").glob("*.json")]
    machine = [
        s
        for s in _strings(entry)
        if s.removeprefix("offline:").startswith((str(PROJECT_ROOT), str(tmp_path)))
    ]
    assert machine == []
    assert (
        entry["config"]["data"]["root"] == "data/micro_coco" and entry["config"]["output_dir"] == "outputs/f1"
    )
    assert local_path(entry["output_dir"], results_dir) == results_dir / "outputs" / "f1"


def test_run_weights_resolve_to_a_file_on_this_machine(results_dir, tmp_path, monkeypatch):
    """``backbone.pretrained=run:<experiment>``: the stored (portable) weights path, as a path here."""
    from vitexp.config.weights import resolve_weights

    weights = results_dir / "outputs" / "teacher" / "weights.pth"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"")
    LedgerEntry("teacher", "train", run_config(), results_dir).start().finish(
        {"top1": 1.0}, artifacts={"weights": weights}
    )
    monkeypatch.chdir(tmp_path)
    assert resolve_weights("run:teacher", results_dir) == str(weights)


def test_the_committed_ledger_holds_no_absolute_machine_path():
    """Results move between machines: no string anywhere in the committed ledger (results/runs/ and
    its packs) is an absolute path of a machine (a project checkout, a temporary or home folder)."""
    import re

    from vitexp import PROJECT_ROOT
    from vitexp.ledger import Ledger

    absolute = re.compile(r'"(offline:)?/(work|tmp|root|home|scratch|mnt|Users)/')
    ledger = Ledger.load(PROJECT_ROOT / "results")
    assert len(ledger) > 500 and not ledger.broken
    offenders = [r["run_id"] for r in ledger if absolute.search(json.dumps(r))]
    assert not offenders, offenders


def test_validation_pins_a_run_reference_and_the_build_reads_that_entry_only(
    make_cfg, results_dir, tmp_path, monkeypatch
):
    """backbone.pretrained=run:<experiment> is resolved once, at validation, to run:<run_id> (the
    ledger then says which run's weights were loaded); building the model opens that one entry
    without scanning the ledger again."""
    import torch

    import vitexp.ledger
    from vitexp.training.build import build_configured_backbone
    from vitexp.training.resolve import validate

    weights = results_dir / "outputs" / "t" / "weights.pth"
    weights.parent.mkdir(parents=True)
    cfg = make_cfg(["backbone=vit_micro", "data=synthetic", "logger=none"])
    torch.save(build_configured_backbone(cfg).state_dict(), weights)
    (results_dir / "runs").mkdir(parents=True, exist_ok=True)
    for run_id, started in (
        ("old", "2026-01-01T00:00:00+00:00"),
        ("new", "2026-01-02T00:00:00+00:00"),
    ):  # by hand
        (results_dir / "runs" / f"{run_id}.json").write_text(
            json.dumps(
                {
                    "run_id": run_id,
                    "experiment": "teacher",
                    "status": "completed",
                    "kind": "train",
                    "started": started,
                    "config": run_config(),
                    "artifacts": {"weights": "outputs/t/weights.pth"},  # relative to the results root
                }
            )
        )
    cfg = make_cfg(["backbone=vit_micro", "data=synthetic", "logger=none", "backbone.pretrained=run:teacher"])
    validate(cfg, need_data=False)
    assert cfg.backbone.pretrained == "run:new"
    scans = []
    original = vitexp.ledger.Ledger.load
    monkeypatch.setattr(vitexp.ledger.Ledger, "load", lambda *a, **k: scans.append(1) or original(*a, **k))
    build_configured_backbone(cfg)
    assert scans == []


def test_an_error_texts_absolute_paths_become_portable_and_a_placeholder_path_stays(tmp_path):
    from vitexp.ledger import portable_text

    text = portable_text(f"no file {tmp_path}/x.pth; `wandb sync <run dir>/wandb/offline-run-*`", tmp_path)
    assert text == "no file x.pth; `wandb sync <run dir>/wandb/offline-run-*`"


def test_only_paths_in_the_checkout_or_the_results_root_are_rewritten(tmp_path):
    """Reproduction 5 of issue 47: the ``data=imagenet`` hint ``/path/to/dataset`` became
    ``../../../path/to/dataset``. A placeholder or a system path stays as written; a path in the
    results root or the checkout becomes relative."""
    from vitexp import PROJECT_ROOT
    from vitexp.ledger import portable_text

    results = tmp_path / "results"
    text = (
        f"data.root=/path/to/dataset; no {results}/outputs/x/last.ckpt; /usr/share/datasets/fashion-mnist; "
        f"{PROJECT_ROOT}/conf/train.yaml"
    )
    assert (
        portable_text(text, results) == "data.root=/path/to/dataset; no outputs/x/last.ckpt; "
        "/usr/share/datasets/fashion-mnist; conf/train.yaml"
    )


def test_stderr_and_the_closing_line_name_a_path_alike(tmp_path, capsys, monkeypatch):
    """A bad checkpoint's path was relative in the closing line and absolute on stderr: both now say
    it the same way (relative to the results root)."""
    from vitexp.commands.cli import _report

    results = tmp_path / "results"
    monkeypatch.setenv("VITEXP_RESULTS", str(results))
    _report(
        "failed",
        FileNotFoundError(f"no checkpoint at {results}/outputs/r1/checkpoints/last.ckpt"),
        "vitexp-train",
    )
    captured = capsys.readouterr()
    closing = json.loads(captured.out.strip().splitlines()[-1])
    assert closing["error"] == "FileNotFoundError: no checkpoint at outputs/r1/checkpoints/last.ckpt"
    assert captured.err.strip() == f"vitexp-train: failed: {closing['error']}"


def test_each_attempt_records_the_slurm_job_and_nodes_it_ran_on(results_dir, monkeypatch):
    """Issue 60: an entry written inside SLURM records its job id and node names, and a requeued run's
    earlier attempt keeps its own; outside SLURM there is no such key."""
    for var in (
        "SLURM_JOB_ID",
        "SLURM_JOB_NODELIST",
        "SLURMD_NODENAME",
        "SLURM_PROCID",
        "SLURM_RESTART_COUNT",
    ):
        monkeypatch.delenv(var, raising=False)
    plain = LedgerEntry("demo", "train", run_config(top={"i": 0}), results_dir).start()
    assert "slurm" not in plain.record["env"]
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    entry = LedgerEntry("demo", "train", run_config(top={"i": 1}), results_dir).start()
    assert entry.record["env"]["slurm"] == {
        "job_id": "77",
        "nodes": "node[1-2]",
        "node": "node1",
        "procid": "0",
    }
    monkeypatch.setenv("SLURMD_NODENAME", "node2")  # the requeue lands on the other node
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    entry.reopen(run_config(top={"i": 1}))
    assert entry.record["attempts"][0]["env"]["slurm"]["node"] == "node1"
    assert (
        entry.record["env"]["slurm"]["node"] == "node2"
        and entry.record["env"]["slurm"]["restart_count"] == "1"
    )
