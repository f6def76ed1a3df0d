"""Tables rendered from a fixture ledger: vitexp beside paper, "not run", cited rows, plots."""

from __future__ import annotations

import csv
import io
import json
import re
from types import SimpleNamespace

import pytest
from conftest import recorded, run_config

from vitexp import SWEEPS_DIR
from vitexp.ledger import LedgerEntry
from vitexp.report import tables

SPEC = {
    "name": "fixture",
    "title": "Fixture table",
    "columns": [
        {"key": "top1", "label": "Top-1", "unit": "%", "digits": 1},
        {"key": "gmacs", "label": "GMACs", "unit": "GMACs", "digits": 2},
    ],
    "plot": {"x": "gmacs", "y": "top1"},
    "rows": [
        {"label": "Trained", "experiment": "exp_a", "paper": {"top1": {"value": 72.2, "source": "Paper T1"}}},
        {
            "label": "Counted only",
            "experiment": "exp_b",
            "paper": {"gmacs": {"value": 4.6, "source": "Paper T1"}},
        },
        {"label": "Never run", "experiment": "exp_c", "paper": {}},
        {"label": "Trained without a FLOPs count", "experiment": "exp_d", "paper": {}},
        {
            "label": "MCTF",
            "cited": True,
            "paper": {"top1": {"value": 80.1, "source": "MCTF"}, "gmacs": {"value": 2.6, "source": "MCTF"}},
        },
    ],
}


@pytest.fixture
def ledger(results_dir):
    old = LedgerEntry("exp_a", "train", run_config(), results_dir).start()
    old.record["started"] = "2000-01-01T00:00:00+00:00"  # the older of the two
    old.finish({"top1": 50.0, "gmacs": 1.0})
    new = LedgerEntry("exp_a", "train", run_config(), results_dir).start()
    new.finish({"top1": 71.23, "gmacs": 1.254})
    LedgerEntry("exp_b", "flops", {}, results_dir).start().finish({"gmacs": 4.5989})
    failed = LedgerEntry("exp_c", "train", run_config(), results_dir).start()
    failed.fail(RuntimeError("crash"))
    LedgerEntry("exp_d", "train", run_config(), results_dir).start().finish({"top1": 60.0})
    return results_dir


def test_cells_from_newest_completed_run_and_not_run(ledger):
    from ledger_records import iter_runs

    rows = tables.fill(SPEC, list(iter_runs(ledger)))
    by = {r["label"]: r for r in rows}
    assert by["Trained"]["cells"]["top1"]["value"] == pytest.approx(71.23)
    assert by["Counted only"]["cells"]["top1"]["value"] is None
    assert by["Counted only"]["cells"]["gmacs"]["value"] == pytest.approx(4.5989)
    assert by["Never run"]["cells"]["top1"]["value"] is None  # the failed run does not count
    md = re.sub(r" +", " ", tables.render_markdown(SPEC, rows))  # tabulate pads columns with spaces
    assert "| Trained | 71.2 | 72.2 | 1.25 | — |" in md
    assert "| Counted only | not run | — | 4.60 | 4.6 |" in md
    assert "| Never run | not run | — | not run | — |" in md
    assert "| Trained without a FLOPs count | 60.0 | — | not run | — |" in md  # not an optional column
    assert "| MCTF | cited, not run | 80.1 | cited, not run | 2.6 |" in md


def test_written_files(ledger, tmp_path):
    from ledger_records import iter_runs

    written = tables.write_table(SPEC, list(iter_runs(ledger)), tmp_path / "tables")
    assert set(written) == {"md", "tex", "csv", "png"}
    rows = list(csv.DictReader(io.StringIO((tmp_path / "tables" / "fixture.csv").read_text())))
    assert (
        rows[2]["top1"] == "not run" and rows[4]["top1"] == "cited, not run" and rows[3]["gmacs"] == "not run"
    )
    assert float(rows[0]["top1"]) == pytest.approx(71.23) and rows[0]["top1_paper"] == "72.2"
    tex = (tmp_path / "tables" / "fixture.tex").read_text()
    assert r"\begin{tabular}" in tex and "not run" in tex
    assert (tmp_path / "tables" / "fixture.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_renders_the_demo_spec(ledger, results_dir, capsys):
    assert tables.main(["demo", "--results-dir", str(results_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["status"] == "completed"
    md = (results_dir / "tables" / "demo.md").read_text()
    assert "not run" in md and "4.6" in md


def test_unknown_table_names_valid_ones(capsys):
    assert tables.main(["nope"]) == 2
    assert "demo" in capsys.readouterr().err


def test_wandb_source(monkeypatch, tmp_path):
    runs = [
        SimpleNamespace(
            id="r1",
            name="x",
            config=run_config(top={"name": "exp_a"}),
            state="finished",
            job_type="train",
            summary={"top1": 70.0, "gmacs": 1.2, "_step": 3},
            created_at="2026-01-01",
            url="u1",
        ),
        SimpleNamespace(
            id="r2",
            name="y",
            config=run_config(top={"name": "exp_b"}),
            state="crashed",
            job_type="flops",
            summary={"gmacs": 4.6},
            created_at="2026-01-02",
            url="u2",
        ),
    ]

    class Api:
        def runs(self, path):
            assert path == "me/vitexp"
            return runs

    import wandb

    monkeypatch.setattr(wandb, "Api", Api)
    records = tables.wandb_runs("me/vitexp")
    rows = {r["label"]: r for r in tables.fill(SPEC, records)}
    assert rows["Trained"]["cells"]["top1"]["value"] == 70.0
    assert rows["Counted only"]["cells"]["gmacs"]["value"] is None  # crashed run is not completed


@pytest.mark.parametrize("spec", sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml")))
def test_every_table_spec_parses_and_names_existing_experiments(spec):
    """A spec that does not parse or names a missing experiment would fail only when a user sweeps it."""
    import yaml

    from vitexp import CONF_DIR
    from vitexp.config.rows import expand_rows

    data = yaml.safe_load((SWEEPS_DIR / f"{spec}.yaml").read_text())
    assert data["title"] and data["columns"] and data["rows"]
    for row in expand_rows(data["rows"]):  # a grid row may template its experiment
        if not row.get("cited"):
            assert (CONF_DIR / "experiment" / f"{row['experiment']}.yaml").is_file(), row["label"]


def test_a_protocol_filter_keeps_a_row_on_the_runs_of_that_protocol():
    """peers_throughput_cpu shows one interleaved comparison: a newer single-model bench of a row
    (another protocol, other images/s) must not replace its cell."""
    from vitexp.report.tables import fill

    spec = {
        "name": "t",
        "protocol": {"mode": "compare"},
        "columns": [{"key": "throughput", "digits": 1}],
        "rows": [{"label": "BSPF", "experiment": "bspf_deit_small", "paper": {}}],
    }
    runs = recorded(
        spec,
        [
            {
                "run_id": "old",
                "experiment": "bspf_deit_small",
                "status": "completed",
                "kind": "bench",
                "protocol": {"mode": "compare"},
                "metrics": {"throughput": 2.7},
            },
            {
                "run_id": "new",
                "experiment": "bspf_deit_small",
                "status": "completed",
                "kind": "bench",
                "protocol": {"mode": "throughput"},
                "metrics": {"throughput": 6.2},
            },
        ],
    )
    assert fill(spec, runs)[0]["cells"]["throughput"]["run_id"] == "old"
    assert fill({**spec, "protocol": None}, runs)[0]["cells"]["throughput"]["run_id"] == "new"


def test_seeded_row_trained_without_an_optional_metric_says_na(results_dir):
    from ledger_records import iter_runs

    from vitexp.data.datamodules import DATA_ORDER

    spec = {
        "name": "seeded_na",
        "title": "t",
        "seeds": [0, 1],
        "columns": [
            {"key": "top1", "label": "Top-1", "unit": "%", "digits": 1},
            {"key": "soft_top1", "label": "Soft", "unit": "%", "digits": 1, "optional": True},
            {"key": "gmacs", "label": "GMACs", "unit": "GMACs", "digits": 1},
        ],
        "rows": [
            {"label": "Probe", "experiment": "probe"},
            {"label": "Pruned", "experiment": "pruned"},
            {"label": "Missing", "experiment": "missing"},
        ],
    }
    for seed in (0, 1):  # runs of today's sampler (data_order): no stale mark
        LedgerEntry(f"probe+seed={seed}", "train", run_config(seed), results_dir).start().finish(
            {"top1": 80.0 + seed}, {"data_order": DATA_ORDER}
        )
        LedgerEntry(f"pruned+seed={seed}", "train", run_config(seed), results_dir).start().finish(
            {"top1": 60.0, "soft_top1": 70.0}, {"data_order": DATA_ORDER}
        )
    md = re.sub(r" +", " ", tables.render_markdown(spec, tables.fill(spec, list(iter_runs(results_dir)))))
    assert "| Probe | 80.5 ± 0.7 (2) | — | n/a | — | not run | — |" in md  # only an optional column says n/a
    assert "| Pruned | 60.0 ± 0.0 (2) | — | 70.0 ± 0.0 (2) | — | not run | — |" in md
    assert "| Missing | not run | — | not run | — | not run | — |" in md


def test_a_column_that_repeats_another_by_construction_says_so_and_shows_its_number_elsewhere(results_dir):
    """SAPER's soft-gated top-1 repeats the selected top-1 under straight-through: such a row says
    "= selected (straight-through)"; a row trained without it, and a straight-through row whose two
    values differ in one seed, show their numbers."""
    from ledger_records import iter_runs

    from vitexp.data.datamodules import DATA_ORDER

    same = {
        "key": "selected_top1",
        "when": {"method.straight_through": True},
        "text": "= selected (straight-through)",
    }
    spec = {
        "name": "soft",
        "title": "t",
        "seeds": [0, 1],
        "columns": [
            {"key": "selected_top1", "label": "Selected", "digits": 1},
            {"key": "soft_top1", "label": "Soft", "digits": 1, "optional": True, "same_as": same},
        ],
        "rows": [
            {"label": "ST", "experiment": "st"},
            {"label": "no ST", "experiment": "soft"},
            {"label": "ST, one seed off", "experiment": "off"},
        ],
    }
    for name, st, soft in (
        ("st", True, (70.0, 71.0)),
        ("soft", False, (70.0, 71.0)),
        ("off", True, (70.0, 71.1)),
    ):
        for seed in (0, 1):
            LedgerEntry(
                f"{name}+seed={seed}",
                "train",
                run_config(seed, {"method": {"straight_through": st}}),
                results_dir,
            ).start().finish(
                {"selected_top1": 70.0 + seed, "soft_top1": soft[seed]}, {"data_order": DATA_ORDER}
            )
    md = re.sub(r" +", " ", tables.render_markdown(spec, tables.fill(spec, list(iter_runs(results_dir)))))
    assert "| ST | 70.5 ± 0.7 (2) | — | = selected (straight-through) | — |" in md
    assert "| no ST | 70.5 ± 0.7 (2) | — | 70.5 ± 0.7 (2) | — |" in md
    assert "| ST, one seed off | 70.5 ± 0.7 (2) | — | 70.5 ± 0.8 (2) | — |" in md
