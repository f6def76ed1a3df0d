"""vitexp-tables --wandb: runs read through wandb.Api, each table and its plot logged back to W&B."""
from __future__ import annotations

import json
from types import SimpleNamespace

from vitexp import tables


def test_tables_wandb_logs_each_table_and_plot(monkeypatch, tmp_path, capsys):
    import wandb

    runs = [SimpleNamespace(id="r1", name="demo", config={"name": "demo"}, state="finished", job_type="train",
                            summary={"top1": 95.0, "gmacs": 0.0226}, created_at="2026-01-01", url="u1")]
    monkeypatch.setattr(wandb, "Api", lambda: SimpleNamespace(runs=lambda path: runs))
    logged: dict = {}
    real_init = wandb.init

    def init(**kwargs):
        run = real_init(mode="offline", dir=str(tmp_path), **kwargs)
        original = run.log
        run.log = lambda data, **kw: (logged.update(data), original(data, **kw))
        return run

    monkeypatch.setattr(wandb, "init", init)
    assert tables.main(["demo", "--wandb", "me/vitexp", "--out", str(tmp_path / "tables")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["status"] == "completed"
    table = logged["demo/table"]
    assert isinstance(table, wandb.Table) and table.columns[:2] == ["row", "experiment"]
    assert any("95.0" in [str(c) for c in row] for row in table.data)
    assert isinstance(logged["demo/plot"], wandb.Image)
