"""A shared start whose weights are not on this machine trains again only for the rows that load it
(vitexp.commands.sweep.plan, issue 45): a new seed of one start's rows retrains that start and its rows,
never another start, its committed seeds, or a row that loads no start."""

from __future__ import annotations

from conftest import config_of

from vitexp.data.datamodules import DATA_ORDER
from vitexp.ledger import LedgerEntry

#: Two starts (demo, tome_demo), a row fine-tuned from each (the ``weights`` key), a row from none;
#: only the rows of tome_demo ask for a seed 2.
SPEC = {
    "name": "s",
    "title": "t",
    "seeds": [0, 1],
    "rows": [
        {"label": "start A", "experiment": "demo", "seeds": None},
        {"label": "ft A", "experiment": "chunk_demo", "weights": "run:demo"},
        {"label": "start B", "experiment": "tome_demo", "seeds": None},
        {"label": "ft B", "experiment": "bspf_demo", "weights": "run:tome_demo", "seeds": [0, 1, 2]},
        {"label": "no start", "experiment": "evit_demo"},
    ],
}


def _run(results_dir, name, seed=None, pretrained=None, weights=None):
    """A completed train run of ``name``; ``pretrained``: the ``backbone.pretrained`` it loaded;
    ``weights``: the weights file it names (a path that is not on this machine)."""
    top = {"backbone": {"pretrained": pretrained}} if pretrained else None
    entry = LedgerEntry(name, "train", config_of(name, seed, top), results_dir).start()
    entry.finish(
        {"top1": 90.0}, {"data_order": DATA_ORDER}, artifacts={"weights": str(weights)} if weights else {}
    )
    return entry.run_id


def test_a_new_seed_retrains_only_the_start_its_row_loads(results_dir, tmp_path, capsys):
    from vitexp.commands.sweep import plan

    for start, ft in (("demo", "chunk_demo"), ("tome_demo", "bspf_demo")):
        _run(results_dir, start, 0, weights=tmp_path / f"gone-{start}.pth")  # committed, weights elsewhere
        for seed in (0, 1):
            _run(results_dir, f"{ft}+seed={seed}", seed, pretrained=f"run:{start}")
    for seed in (0, 1):
        _run(results_dir, f"evit_demo+seed={seed}", seed)
    todo = plan(SPEC, None, False, results_dir)["train"]
    assert todo["loads"] == {
        "demo": None,
        "chunk_demo": "demo",
        "tome_demo": None,
        "bspf_demo": "tome_demo",
        "evit_demo": None,
    }
    assert todo["launch"] == ["tome_demo", "bspf_demo+seed=0", "bspf_demo+seed=1", "bspf_demo+seed=2"]
    assert todo["seeds"] == {"bspf_demo": [0, 1, 2]}  # its seeds 0, 1 loaded the old run of tome_demo
    assert sorted(todo["skip"]) == [
        "chunk_demo+seed=0",
        "chunk_demo+seed=1",
        "demo",
        "evit_demo+seed=0",
        "evit_demo+seed=1",
    ]
    err = capsys.readouterr().err
    assert "tome_demo is the shared start other rows load (run:tome_demo), and its weights are not" in err
    assert (
        "demo is the shared start other rows load (run:demo); its weights are not on this machine, but" in err
    )
    complete = {**SPEC, "rows": [{**r, "seeds": [0, 1]} if r["label"] == "ft B" else r for r in SPEC["rows"]]}
    assert (
        plan(complete, None, False, results_dir)["train"]["launch"] == []
    )  # no seed to train: no start trains


def test_a_start_named_in_the_experiment_file_is_the_rows_start(results_dir):
    """A row whose experiment config sets ``backbone.pretrained: run:<start>`` (the Fashion-MNIST
    fine-tunings) loads that start as surely as one with a ``weights`` key."""
    from vitexp.commands.sweep import plan

    spec = {
        "name": "s",
        "title": "t",
        "seeds": [0],
        "rows": [
            {"label": "start", "experiment": "fmnist_caformer_micro_baseline", "seeds": None},
            {"label": "ft", "experiment": "fmnist_caformer_micro_ft"},
            {
                "label": "overridden",
                "experiment": "fmnist_bspf_caformer_micro",
                "weights": "run:fmnist_caformer_micro_ft",
            },
        ],
    }
    loads = plan(spec, None, False, results_dir)["train"]["loads"]
    assert loads == {
        "fmnist_caformer_micro_baseline": None,
        "fmnist_caformer_micro_ft": "fmnist_caformer_micro_baseline",
        "fmnist_bspf_caformer_micro": None,
    }  # run:<a row that is no shared start>: no start
