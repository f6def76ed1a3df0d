"""vitexp-tables and W&B: runs read through wandb.Api, each table and its plot logged back to W&B;
``--log-wandb`` logs the local ledger's tables, offline too."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import config_of

from vitexp.ledger import local_path, portable_paths
from vitexp.report import tables


@pytest.fixture
def logged(monkeypatch) -> dict:
    """What vitexp-tables logs to W&B: every ``run.log`` call's data, and ``wandb.init``'s arguments."""
    import wandb

    seen: dict = {"init": None, "data": {}}
    real_init = wandb.init

    def init(**kwargs):
        seen["init"] = kwargs
        run = real_init(**kwargs)
        original = run.log
        run.log = lambda data, **kw: (seen["data"].update(data), original(data, **kw))
        return run

    monkeypatch.setattr(wandb, "init", init)
    return seen


def _assert_demo_table(data: dict, top1: str) -> None:
    import wandb

    table = data["demo/table"]
    assert isinstance(table, wandb.Table) and table.columns[:2] == ["row", "experiment"]
    assert any(top1 in [str(c) for c in row] for row in table.data)
    assert isinstance(data["demo/plot"], wandb.Image)


def test_tables_wandb_logs_each_table_and_plot(monkeypatch, tmp_path, capsys, logged):
    import wandb

    runs = [
        SimpleNamespace(
            id="r1",
            name="demo",
            config=config_of("demo"),
            state="finished",
            job_type="train",
            summary={"top1": 95.0, "gmacs": 0.0226},
            created_at="2026-01-01",
            url="u1",
        )
    ]
    monkeypatch.setattr(wandb, "Api", lambda: SimpleNamespace(runs=lambda path: runs))
    assert tables.main(["demo", "--wandb", "me/vitexp", "--out", str(tmp_path / "tables")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["status"] == "completed"
    assert (logged["init"]["entity"], logged["init"]["project"]) == ("me", "vitexp")
    _assert_demo_table(logged["data"], "95.0")


def test_log_wandb_logs_the_local_ledger_offline(monkeypatch, tmp_path, capsys, logged):
    """No W&B login, WANDB_MODE=offline: the tables of the local ledger go to an offline W&B run of
    the project runs log to, which the closing line names for ``wandb sync``."""
    results = tmp_path / "results"
    (results / "runs").mkdir(parents=True)
    (results / "runs" / "r1.json").write_text(
        json.dumps(
            {
                "run_id": "r1",
                "experiment": "demo",
                "status": "completed",
                "kind": "train",
                "started": "2026-01-01T00:00:00+00:00",
                "config": portable_paths(config_of("demo"), results),  # as an entry stores it
                "metrics": {"top1": 93.25, "gmacs": 0.0226},
            }
        )
    )
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert tables.main(["demo", "--log-wandb", "--results-dir", str(results)]) == 0
    closing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert logged["init"]["project"] == "vitexp" and logged["init"]["mode"] == "offline"
    _assert_demo_table(logged["data"], "93.25")
    # reproduction 5 of issue 47: the folder is named relative to the results root, as every path of a closing
    # line
    assert closing["wandb"].startswith("offline:wandb/")
    assert local_path(closing["wandb"].removeprefix("offline:"), results).parent.name.startswith(
        "offline-run-"
    )


def test_wandb_runs_are_matched_by_their_config(monkeypatch, tmp_path, capsys, logged):
    """Reproduction 3 of issue 47: W&B runs carry no fingerprint, so every --wandb table matched by
    name alone. A newer run named demo with another recipe.lr is not the demo row's; the run of its
    configuration is."""
    import wandb

    runs = [
        SimpleNamespace(
            id="r1",
            name="demo",
            config=config_of("demo"),
            state="finished",
            job_type="train",
            summary={"top1": 94.4},
            created_at="2026-01-01T00:00:00",
            url="u1",
        ),
        SimpleNamespace(
            id="r2",
            name="demo",
            config=config_of("demo", None, {"recipe": {"lr": 0.5}}),
            state="finished",
            job_type="train",
            summary={"top1": 12.3},
            created_at="2026-01-02T00:00:00",
            url="u2",
        ),
    ]
    monkeypatch.setattr(wandb, "Api", lambda: SimpleNamespace(runs=lambda path: runs))
    assert tables.main(["demo", "--wandb", "me/vitexp", "--out", str(tmp_path / "tables")]) == 0
    md = (tmp_path / "tables" / "demo.md").read_text()
    assert "94.4" in md and "12.3" not in md
    assert "r2 (recipe.lr)" in capsys.readouterr().err


def test_a_wandb_project_that_cannot_be_read_is_named_as_wandb(monkeypatch, tmp_path, capsys):
    import wandb

    def refuse(path):
        raise ValueError("Could not find project vitexp")

    monkeypatch.setattr(wandb, "Api", lambda: SimpleNamespace(runs=refuse))
    assert tables.main(["demo", "--wandb", "me/vitexp", "--out", str(tmp_path / "tables")]) == 1
    closing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert closing["error"] == "W&B me/vitexp: ValueError: Could not find project vitexp"
