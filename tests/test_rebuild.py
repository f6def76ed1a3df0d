"""‡ with a stated rule (vitexp/commands/rebuild.py, vitexp/ledger/marks.py): a run recorded as dirty without
its diff keeps its mark unless a rerun at its recorded commit gave every recorded metric again."""

from __future__ import annotations

import re

from conftest import run_config

from vitexp.commands import rebuild
from vitexp.ledger import Ledger, LedgerEntry, marks
from vitexp.report import tables

RUN = {
    "run_id": "r",
    "experiment": "fmnist_evit_vit_micro+seed=1",
    "kind": "train",
    "config": {
        "seed": 1,
        "backbone": {"pretrained": "run:20261130-093404-train-start-420a24"},
        "recipe": {"lr": 1e-3},
    },
    "metrics": {
        "top1": 85.21,
        "test_loss": 0.41,
        "fit_time_s": 167.2,
        "wall_time_s": 190.0,
        "throughput": 812.0,
    },
    "artifacts": {"weights_sha256": "ab"},
}


def _rerun(**changes):
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in RUN.items()}
    out["metrics"] = {**RUN["metrics"], "fit_time_s": 171.9, "wall_time_s": 201.3, "throughput": 640.0}
    for key, value in changes.items():
        where, _, name = key.partition("__")
        out[where] = {**out[where], name: value}
    return out


def test_a_rebuild_compares_every_untimed_metric_the_weights_and_the_config():
    assert rebuild.compared(RUN, _rerun()) == (3, [])  # top1, test_loss, the weights' hash; no timing
    n, differences = rebuild.compared(RUN, _rerun(metrics__top1=85.22))
    assert differences == ["metrics.top1: 85.21 recorded, 85.22 rebuilt"]
    assert rebuild.compared(RUN, _rerun(artifacts__weights_sha256="cd"))[1] == [
        "artifacts.weights_sha256 differs"
    ]
    assert rebuild.compared(RUN, _rerun(config__recipe={"lr": 2e-3}))[1] == ["config.recipe.lr differs"]
    assert rebuild.compared(RUN, {**_rerun(), "config": {**RUN["config"], "extra": 1}})[1] == [
        "config.extra differs"
    ]


def test_the_rerun_is_the_runs_own_command():
    assert rebuild.arguments(RUN) == [
        "experiment=fmnist_evit_vit_micro",
        "seed=1",
        "backbone.pretrained=run:20261130-093404-train-start-420a24",
        "logger=none",
        "trainer.enable_progress_bar=false",
    ]


def _verdict(results_dir, run_id: str, ok: bool, started: str) -> None:
    entry = LedgerEntry(rebuild.REBUILD_NAME, rebuild.REBUILD_KIND, {"rebuilds": run_id}, results_dir).start()
    entry.record["started"] = started
    entry.finish(
        {"compared": 3}, rebuilds=run_id, rebuilt=ok, differences=[] if ok else ["metrics.top1 differs"]
    )


def test_a_table_drops_the_mark_of_a_rebuilt_run_only_and_counts_it(results_dir):
    """Two dirty runs without a kept diff: the one whose newest rebuild entry says rebuilt loses its
    ‡ and is counted in the notes; the other (rebuilt once, then not) keeps it."""
    ids = {}
    for name in ("a", "b"):
        entry = LedgerEntry(name, "train", run_config(), results_dir).start()
        entry.record["env"].update(git_dirty=True, code_patch=None)
        entry.finish({"top1": 80.0})
        ids[name] = entry.run_id
    _verdict(results_dir, ids["a"], True, "2026-01-01T00:00:00+00:00")
    _verdict(results_dir, ids["b"], True, "2026-01-01T00:00:00+00:00")
    _verdict(results_dir, ids["b"], False, "2026-01-02T00:00:00+00:00")
    ledger = Ledger.load(results_dir)
    assert ledger.rebuilt == {ids["a"]} and all(marks.diff_missing(ledger.get(i)) for i in ids.values())
    spec = {
        "name": "t",
        "title": "t",
        "columns": [{"key": "top1", "label": "Top-1", "digits": 1}],
        "rows": [{"label": "A", "experiment": "a"}, {"label": "B", "experiment": "b"}],
    }
    md = re.sub(r" +", " ", tables.render_markdown(spec, tables.fill(spec, ledger)))
    assert "| A | 80.0 | — |" in md and "| B | 80.0 ‡ | — |" in md
    assert (
        "(1 cell)." in md
        and "- 1 cell, recorded as trained from a dirty tree without its diff, carry no ‡" in md
    )


def test_a_run_launched_under_a_name_is_rerun_from_its_recorded_config():
    """Every leaf the fingerprint keeps becomes ++key=value that Hydra's parser reads back to the
    recorded value (strings with quotes, lists, empty mappings, null); excluded keys are left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    run = {
        "experiment": "evit_deit_small_keep09",
        "config": {
            "name": "evit_deit_small_keep09",
            "output_dir": "/x",
            "seed": 42,
            "backbone": {
                "name": "deit_small",
                "kwargs": {},
                "pretrained": None,
                "bspf": {"prune_layers": [4, 6, 9]},
            },
            "method": {"_target_": "vitexp.methods.evit.EViT", "name": "evit", "note": "it's a:b"},
            "budget": {"kind": "keep_ratio", "keep_ratio": 0.9},
            "recipe": {"name": "r", "warmup_lr": 1e-06},
        },
    }
    args = rebuild.config_arguments(run)
    assert args[:3] == ["backbone=deit_small", "method=evit", "budget=keep_ratio"] and "recipe=r" in args
    parsed = {
        o.key_or_group: o.value()
        for o in OverridesParser.create().parse_overrides([a for a in args if a.startswith("++")])
    }
    assert parsed == {
        "seed": 42,
        "backbone.name": "deit_small",
        "backbone.kwargs": {},
        "backbone.pretrained": None,
        "backbone.bspf.prune_layers": [4, 6, 9],
        "method.name": "evit",
        "method.note": "it's a:b",
        "budget.kind": "keep_ratio",
        "budget.keep_ratio": 0.9,
        "recipe.name": "r",
        "recipe.warmup_lr": 1e-06,
    }


def test_a_rerun_calls_the_console_scripts_where_its_commit_has_them(tmp_path):
    """A ‡ run of a commit before the package layout reruns through vitexp.cli; a later one through
    vitexp.commands.cli; and every commit the ledger's rebuild entries name has vitexp/cli.py."""
    import subprocess

    from vitexp import PROJECT_ROOT

    old, new = tmp_path / "old", tmp_path / "new"
    (old / "vitexp").mkdir(parents=True)
    (old / "vitexp" / "cli.py").write_text("")
    (new / "vitexp" / "commands").mkdir(parents=True)
    (new / "vitexp" / "commands" / "cli.py").write_text("")
    assert rebuild.cli_module(old) == "vitexp.cli"
    assert rebuild.cli_module(new) == "vitexp.commands.cli"
    assert rebuild.cli_module(PROJECT_ROOT) == "vitexp.commands.cli"
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", "8cd9138", "vitexp/cli.py"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode == 0:  # a clone with the history: the last commit before the layout
        assert listed.stdout.strip() == "vitexp/cli.py"
