"""``vitexp-sweep TABLE --kind eval``: the runs a table cites are re-evaluated once each, and a
re-evaluated top-1 that differs from the ledger's fails the check (constructed ledger, fake vitexp-eval)."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from conftest import run_config
from ledger_records import iter_runs

from vitexp.commands import recheck, sweep
from vitexp.ledger import LedgerEntry
from vitexp.report import aggregate, tables

SPEC = {
    "name": "recheck_fixture",
    "title": "Recheck fixture",
    "seeds": [0, 1],
    "columns": [{"key": "top1", "label": "Top-1", "unit": "%", "digits": 2}],
    "rows": [
        {"label": "Pretrained", "experiment": "pre", "seeds": None},
        {"label": "Baseline", "experiment": "base"},
        {"label": "Method", "experiment": "meth", "baseline": "base"},
        {"label": "Method again (a second table row on the same runs)", "experiment": "meth"},
        {"label": "Cost only", "experiment": "meth", "run": "flops", "seeds": None},
    ],
}


def _train(results_dir, name, seed, top1, started=None):
    entry = LedgerEntry(name, "train", run_config(seed), results_dir).start()
    if started:
        entry.record["started"] = started
    entry.finish({"top1": top1})
    return entry.record["run_id"]


def _eval(results_dir, run_id, top1):
    """As vitexp-eval records it: under the training run's name and config, ``evaluates`` its id."""
    trained = next(r for r in iter_runs(results_dir) if r["run_id"] == run_id)
    entry = LedgerEntry(trained["experiment"], "eval", trained["config"], results_dir).start()
    entry.record["evaluates"] = run_id
    entry.finish({"top1": top1})


@pytest.fixture
def ledger(results_dir):
    _train(results_dir, "pre", 0, 12.0, started="2000-01-01T00:00:00+00:00")  # older: not cited
    ids = {"pre": _train(results_dir, "pre", 0, 88.0)}
    for seed in (0, 1):
        ids[("base", seed)] = _train(results_dir, aggregate.seeded_name("base", seed), seed, 90.0 + seed)
    _train(results_dir, "meth+seed=0", 0, 50.0, started="2000-01-01T00:00:00+00:00")  # older: not cited
    ids[("meth", 0)] = _train(results_dir, "meth+seed=0", 0, 86.0)  # started now: the newest
    return ids


def test_cited_runs_are_the_tables_newest_per_seed_once_each(ledger, results_dir):
    cited = recheck.cited_runs(SPEC, results_dir)
    assert [(c["row"], c["seed"], c["metrics"]) for c in cited] == [
        ("pre", None, {"top1": 88.0}),
        ("base", 0, {"top1": 90.0}),
        ("base", 1, {"top1": 91.0}),
        ("meth", 0, {"top1": 86.0}),
    ]
    assert cited[-1]["run_id"] == ledger[("meth", 0)]


def test_agreeing_disagreeing_already_evaluated_and_failed_runs(ledger, results_dir):
    _eval(results_dir, ledger["pre"], 88.0)  # evaluated before: not evaluated again
    reevaluated = {ledger[("base", 0)]: 90.0, ledger[("base", 1)]: 91.0 + 0.005, ledger[("meth", 0)]: 85.5}
    calls = []

    def evaluate(run_id):
        calls.append(run_id)
        if run_id in reevaluated:
            _eval(results_dir, run_id, reevaluated[run_id])
        return 0

    result = recheck.recheck(SPEC, results_dir, evaluate)
    assert calls == [ledger[("base", 0)], ledger[("base", 1)], ledger[("meth", 0)]]
    filled = {r["label"]: r for r in tables.fill(SPEC, iter_runs(results_dir))}  # eval entries fill no cell
    assert filled["Method"]["cells"]["top1"]["value"] == pytest.approx(86.0)
    assert filled["Pretrained"]["cells"]["top1"]["run_id"] == ledger["pre"]
    assert filled["Baseline"]["cells"]["top1"]["seeds"] == {0: 90.0, 1: 91.0}  # not the re-evaluated 91.005
    assert result["disagree"] == [ledger[("meth", 0)]]  # 85.5 vs 86.0: the rebuilt model is another one
    assert result["not_evaluated"] == []
    meth = result["runs"][-1]
    assert meth["diff"] == {"top1": pytest.approx(-0.5)} and meth["agrees"] is False
    assert "DISAGREES" in recheck.report_lines(result)[-1]

    calls.clear()
    again = recheck.recheck(SPEC, results_dir, evaluate)
    assert calls == [] and again["disagree"] == [ledger[("meth", 0)]]  # nothing evaluated twice
    recheck.recheck(SPEC, results_dir, evaluate, force=True)
    assert len(calls) == 4

    failing = recheck.recheck(SPEC, results_dir, lambda run_id: 1, force=True)
    assert failing["not_evaluated"] == [c["run_id"] for c in recheck.cited_runs(SPEC, results_dir)]


@pytest.mark.parametrize(
    "reevaluated, agrees", [(90.01, True), (89.99, True), (90.02, False), (89.98, False)]
)
def test_one_image_of_ten_thousand_agrees_two_do_not(results_dir, reevaluated, agrees):
    spec = {**SPEC, "rows": [{"label": "Pretrained", "experiment": "pre", "seeds": None}]}
    run_id = _train(results_dir, "pre", 0, 90.0)
    result = recheck.recheck(spec, results_dir, lambda rid: _eval(results_dir, rid, reevaluated) or 0)
    assert result["disagree"] == ([] if agrees else [run_id])


def _detector_eval(results_dir, run_id, ap_box, ap_mask):
    trained = next(r for r in iter_runs(results_dir) if r["run_id"] == run_id)
    entry = LedgerEntry(trained["experiment"], "eval", trained["config"], results_dir).start()
    entry.record["evaluates"] = run_id
    entry.finish({"ap_box": ap_box, "ap_mask": ap_mask, "top1": 0.0})


@pytest.mark.parametrize("ap_mask, agrees", [(25.0, True), (25.02, False)])
def test_a_detector_run_is_checked_on_both_aps(results_dir, ap_mask, agrees):
    spec = {**SPEC, "rows": [{"label": "Detector", "experiment": "det"}]}
    entry = LedgerEntry(
        "det+seed=0", "train", run_config(top={"seed": 0, "objective": "detect"}), results_dir
    ).start()
    entry.finish({"ap_box": 30.0, "ap_mask": 25.0})
    no_aps = LedgerEntry(
        "det+seed=1", "train", run_config(top={"seed": 1, "objective": "detect"}), results_dir
    ).start()
    no_aps.finish({"top1": 50.0})  # recorded no AP: nothing to compare
    run_id = entry.record["run_id"]
    result = recheck.recheck(
        spec, results_dir, lambda rid: _detector_eval(results_dir, rid, 30.0, ap_mask) or 0
    )
    (row,) = result["runs"]
    assert row["run_id"] == run_id and row["metrics"] == {"ap_box": 30.0, "ap_mask": 25.0}
    assert row["eval_metrics"] == {"ap_box": 30.0, "ap_mask": ap_mask} and row["agrees"] is agrees
    assert result["disagree"] == ([] if agrees else [run_id])
    assert result["not_checkable"] == [no_aps.record["run_id"]]
    assert "ap_mask 25.00 % in the ledger" in recheck.report_lines(result)[-1]


def test_cli_runs_vitexp_eval_per_run_and_fails_on_a_disagreement(
    ledger, results_dir, tmp_path, monkeypatch, capsys
):
    spec_path = tmp_path / "recheck_fixture.yaml"
    spec_path.write_text(yaml.safe_dump({k: v for k, v in SPEC.items() if k != "name"}))
    top1 = {
        ledger["pre"]: 88.0,
        ledger[("base", 0)]: 90.0,
        ledger[("base", 1)]: 91.0,
        ledger[("meth", 0)]: 86.0,
    }
    commands, environments = [], []
    real_run = subprocess.run

    def fake_run(cmd, **kwargs):
        if cmd[0] != "vitexp-eval":
            return real_run(cmd, **kwargs)  # the ledger's own git calls
        commands.append(cmd)
        environments.append(kwargs["env"])
        _eval(results_dir, cmd[1], top1[cmd[1]])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setenv("VITEXP_RESULTS", str(tmp_path / "another_ledger"))  # results_dir= is the one to use
    monkeypatch.setattr(sweep, "_script", lambda app: app)
    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    argv = [str(spec_path), f"results_dir={results_dir}", "data.root=/elsewhere", "--kind", "eval"]
    assert sweep.main([*argv, "--dry-run"]) == 0 and commands == []
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["status"] == "dry_run" and summary["would_evaluate"] == list(top1)

    rc = sweep.main(argv)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and summary["status"] == "completed" and summary["disagree"] == []
    assert [c[:2] for c in commands] == [["vitexp-eval", rid] for rid in top1]
    assert commands[0][2:] == ["data.root=/elsewhere"]  # vitexp-eval finds the ledger by $VITEXP_RESULTS
    assert environments[0]["VITEXP_RESULTS"] == str(results_dir)
    assert summary["evaluated"] == list(top1) and summary["checked"] == 4

    top1[ledger[("meth", 0)]] = 70.0
    rc = sweep.main([str(spec_path), f"results_dir={results_dir}", "--kind", "eval", "--force"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and summary["status"] == "failed" and summary["disagree"] == [ledger[("meth", 0)]]
