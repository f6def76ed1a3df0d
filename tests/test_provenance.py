"""Provenance of the papers' numbers in the table specs (sweeps/*.yaml): every paper value names
where it was read; a value obtained by arithmetic is marked derived, carries its formula and is
rendered with a mark and a footnote (vitexp/report/tables.py)."""

from __future__ import annotations

import csv
import io
import re

import pytest
import yaml

from vitexp import CONF_DIR, SWEEPS_DIR
from vitexp.report import tables
from vitexp.report.provenance import evaluate_formula, provenance_errors

SPECS = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))

#: values the papers give only as a gain over a baseline: (spec, experiment, column, formula); every
#: derived value of every spec is on this list (test_every_derived_value_is_on_the_list)
KNOWN_DERIVED = [
    ("bspf_table1", "bspf_deit_tiny", "top1", "72.2 + 1.3"),
    ("bspf_table1", "bspf_deit_small", "top1", "79.8 + 2.0"),
    ("bspf_table2", "bspf_t2t_vit_14", "top1", "81.5 + 0.9"),
    ("bspf_table2", "bspf_lvvit_s", "top1", "83.3 + 0.8"),
    ("bspf_table8", "bspf_deit_small", "top1", "79.8 + 2.0"),
    ("peers_deit_small", "bspf_deit_small", "top1", "79.8 + 2.0"),
]
#: The published baselines BSPF-ViT compares with: each cell cites the peer's own publication and says
#: whether it was checked against it (docs/reading-peers.md, "Where the peers' published numbers were
#: checked").
#: label prefix -> checked? (EViT, top-1 checked and GMACs not: test_evit_values_name_where_each_was_read)
PEERS = {"MCTF": True, "DynamicViT": True, "SPViT": False, "ToMe": False}


def _raw(name: str) -> dict:
    return yaml.safe_load((SWEEPS_DIR / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", SPECS)
def test_every_paper_value_names_its_source_and_derived_ones_their_formula(name):
    spec = _raw(name)
    for row in spec["rows"]:
        for key, cell in (row.get("paper") or {}).items():
            assert str(cell.get("source") or "").strip(), (row["label"], key)
            if cell.get("derived"):
                assert evaluate_formula(cell["formula"]) == pytest.approx(cell["value"], abs=1e-9), row[
                    "label"
                ]
    assert provenance_errors(spec) == []
    tables.load_spec(name)  # the loader enforces the same rules


@pytest.mark.parametrize("name,experiment,key,formula", KNOWN_DERIVED)
def test_gains_turned_into_values_are_marked_derived(name, experiment, key, formula):
    cells = [
        r["paper"][key]
        for r in _raw(name)["rows"]
        if r.get("experiment") == experiment and key in r.get("paper", {})
    ]
    assert cells, f"{name}: no paper {key} for {experiment}"
    for cell in cells:
        assert cell.get("derived") is True and cell.get("formula") == formula


def test_evit_values_name_where_each_was_read():
    """EViT's README gives top-1 per keep rate (checked against it) but no GMACs: those are EViT's
    paper's, not checked."""
    for name in ("bspf_table1", "peers_deit_small"):
        rows = [r for r in _raw(name)["rows"] if r["label"].startswith("EViT") and r.get("paper")]
        assert len(rows) >= 3 and all(r.get("experiment") for r in rows)  # runnable rows, not cited ones
        for row in rows:
            top1 = row["paper"]["top1"]["source"]
            assert (
                top1.startswith("EViT README") and "BSPF" not in top1 and "checked against the README" in top1
            )
        assert sum("gmacs" in r["paper"] for r in rows) == 3  # keep 0.7, 0.6, 0.5
        for row in (r for r in rows if "gmacs" in r["paper"]):
            gmacs = row["paper"]["gmacs"]["source"]
            assert (
                gmacs.startswith("EViT (Liang et al., ICLR 2022)")
                and "unchecked" in gmacs
                and "BSPF" not in gmacs
            )


def _derived_cells() -> set[tuple[str, str, str, str]]:
    found = set()
    for name in SPECS:
        for row in tables.load_spec(name)["rows"]:  # grid rows expanded
            for key, cell in (row.get("paper") or {}).items():
                if cell.get("derived"):
                    found.add((name, row.get("experiment") or row["label"], key, cell.get("formula")))
    return found


def test_every_derived_value_is_on_the_list():
    """A value obtained by arithmetic anywhere in sweeps/ is one of KNOWN_DERIVED: a new one is
    reviewed here before a table prints it, and one that left a spec leaves the list."""
    found = _derived_cells()
    assert found - set(KNOWN_DERIVED) == set(), "derived values not on KNOWN_DERIVED"
    assert set(KNOWN_DERIVED) - found == set(), "KNOWN_DERIVED lists values no spec derives"


@pytest.mark.parametrize("name", SPECS)
def test_no_value_is_cited_second_hand(name):
    """A value is cited from the publication it belongs to, never "as cited in" another paper."""
    for row in _raw(name)["rows"]:
        for key, cell in (row.get("paper") or {}).items():
            assert "as cited" not in str(cell.get("source")), (name, row["label"], key)


def test_peer_values_cite_the_peers_publication_and_say_whether_it_was_checked():
    cells = [
        (row["label"], key, cell["source"])
        for name in SPECS
        for row in _raw(name)["rows"]
        for key, cell in (row.get("paper") or {}).items()
        if row["label"].startswith(tuple(PEERS))
    ]
    assert len(cells) >= 11  # MCTF, SPViT, DynamicViT and ToMe in BSPF-ViT's Table 1 alone
    for label, key, source in cells:
        peer = next(p for p in PEERS if label.startswith(p))
        assert source.startswith(peer), (label, key, source)
        if PEERS[peer]:
            assert "checked against" in source and "unchecked" not in source, (label, key, source)
        else:
            assert "unchecked" in source, (label, key, source)


@pytest.mark.parametrize(
    "cell,complaint",
    [
        ({"value": 73.5}, "no source"),
        ({"value": 73.5, "source": "  "}, "no source"),
        ({"value": 73.5, "source": "BSPF-ViT abstract", "derived": True}, "without a formula"),
        (
            {"value": 73.5, "source": "BSPF-ViT abstract", "derived": True, "formula": "72.2 + 1.7"},
            "not 73.5",
        ),
        ({"value": 82.4, "source": "BSPF-ViT Table 2 (81.5 + 0.9)"}, "mark it derived"),
        ({"value": 81.8, "source": "BSPF-ViT Table 1 (+2.0)"}, "mark it derived"),
    ],
)
def test_the_loader_refuses_a_value_without_provenance(tmp_path, cell, complaint):
    spec = {
        "title": "t",
        "columns": [{"key": "top1", "label": "Top-1"}],
        "rows": [{"label": "BSPF row", "experiment": "demo", "paper": {"top1": cell}}],
    }
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match=complaint) as err:
        tables.load_spec(path)
    assert "BSPF row" in str(err.value)


def test_derived_values_and_notes_are_marked_in_every_rendering(tmp_path):
    spec = {
        "name": "prov",
        "title": "Provenance fixture",
        "plot": {"x": "gmacs", "y": "top1"},
        "notes": ["Prune layers fitted to the paper's GMACs."],
        "columns": [
            {"key": "top1", "label": "Top-1", "digits": 1},
            {"key": "gmacs", "label": "GMACs", "digits": 2},
        ],
        "rows": [
            {
                "label": "BSPF",
                "experiment": "x",
                "paper": {
                    "top1": {
                        "value": 73.5,
                        "source": "BSPF-ViT abstract",
                        "derived": True,
                        "formula": "72.2 + 1.3",
                    },
                    "gmacs": {"value": 0.6, "source": "BSPF-ViT Table 1"},
                },
            }
        ],
    }
    rows = tables.fill(spec, [])
    md = tables.render_markdown(spec, rows)
    md = re.sub(r" {2,}", " ", md)  # tabulate pads the cells of a column to one width
    assert "| BSPF | not run | 73.5† | not run | 0.6 |" in md
    assert "† BSPF, Top-1: 73.5 = 72.2 + 1.3, obtained by arithmetic from BSPF-ViT abstract." in md
    assert "- Prune layers fitted to the paper's GMACs." in md
    tex = tables.render_latex(spec, rows)
    assert r"73.5\textsuperscript{\dag}" in tex and "72.2 + 1.3" in tex and "Prune layers fitted" in tex
    line = next(csv.DictReader(io.StringIO(tables.render_csv(spec, rows))))
    assert line["top1_paper"] == "73.5" and line["top1_paper_formula"] == "72.2 + 1.3"
    assert line["gmacs_paper_formula"] == ""
    written = tables.write_table(spec, [], tmp_path)
    assert set(written) == {"md", "tex", "csv", "png"}


RECIPES = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))


def _header(recipe: str) -> list[str]:
    lines = (CONF_DIR / "recipe" / f"{recipe}.yaml").read_text().splitlines()
    return [
        line[1:].strip()
        for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_names_its_source_or_says_it_is_vitexps_choice(recipe):
    source = " ".join(_header(recipe)).partition("Source:")[2]
    assert source.strip(), f"conf/recipe/{recipe}.yaml: no 'Source:' in its header comment"
    assert any(
        word in source for word in ("paper", "README", "repository", "reference code", "vitexp's choice")
    )


def test_deit_finetune_claims_no_schedule_the_papers_share():
    header = " ".join(_header("deit_finetune"))
    assert "DynamicViT, EViT and" not in header and "vitexp's choice" in header
    for fact in ("300 epochs", "lr 2e-5", "wd 1e-6", "no warm-up", "not published"):
        assert fact in header, fact
