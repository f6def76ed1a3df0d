"""The results page (vitexp/report/results_page.py): every spec's verdict fills from its own table's
cells, a placeholder naming a row or column the table lacks is refused, no verdict types a
measured number by hand, and vitexp-tables writes the page."""

from __future__ import annotations

import re

import pytest
from conftest import recorded

from vitexp import SWEEPS_DIR
from vitexp.report import results_page, tables

VERDICTS = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml") if "verdict:" in p.read_text())
#: What a measured number typed into prose looks like: a mean ± std, a percentage (whole or not), a
#: signed Δ, a number with two or more decimals, a one-decimal number of 10 or more (an accuracy such as
#: "81.4"; a setting such as "keep 0.45" or "ρ = 0.5" is not one).
MEASURED = re.compile(
    r"\d+\.\d+\s*±|±\s*\d|\d+(?:\.\d+)?\s*%|Δ\s*[−+-]?\s*\d|(?<!keep )(?<!= )\b\d+\.\d{2,}"
    r"|(?<![\w.])\d{2,}\.\d\b(?!\.)"
)

SPEC = {
    "name": "page_fixture",
    "title": "Page fixture",
    "seeds": [0, 1, 2],
    "columns": [
        {"key": "top1", "label": "Top-1", "unit": "%", "digits": 2, "paired": True},
        {"key": "gmacs", "label": "GMACs", "unit": "GMACs", "digits": 3},
    ],
    "rows": [
        {"label": "base", "experiment": "demo", "paper": {"top1": {"value": 79.8, "source": "DeiT paper"}}},
        {"label": "method", "experiment": "bspf_demo", "baseline": "demo", "paper": {}},
    ],
}


def _runs():
    out = []
    for name, top1 in (("demo", {0: 80.0, 1: 82.0, 2: 84.0}), ("bspf_demo", {0: 79.0, 1: 80.0, 2: 84.0})):
        for seed, value in top1.items():
            out.append(
                {
                    "run_id": f"{name}-{seed}",
                    "experiment": f"{name}+seed={seed}",
                    "status": "completed",
                    "kind": "train",
                    "config": {"seed": seed},
                    "metrics": {"top1": value, "gmacs": 0.0226},
                }
            )
    return out


def test_placeholders_fill_from_the_cells():
    spec = {
        **SPEC,
        "verdict": (
            "{cell:demo:top1}; {cell:demo:gmacs}; {delta:bspf_demo:top1}; "
            "{diff:bspf_demo:demo:top1}; {paper:demo:top1}; {cell:bspf_demo:top1}"
        ),
    }
    text = results_page.fill_verdict(spec, tables.fill(spec, recorded(spec, _runs())))
    # 82 ± 2; cost without std; paired Δ: (−1, −2, 0) → −1 ± 1; the same as diff; the paper's 79.8 as
    # published; 81 ± 2.65
    assert text == "82.00 ± 2.00; 0.023; −1.00 ± 1.00; −1.00 ± 1.00; 79.8; 81.00 ± 2.65"
    partial = {
        **SPEC,
        "verdict": (
            "{cell:bspf_demo:top1}; {delta:bspf_demo:top1}; {diff:bspf_demo:demo:top1}; {cell:demo:top1}"
        ),
    }
    runs = [r for r in _runs() if r["run_id"] != "bspf_demo-2"]  # a seed still running: the prose says so
    assert (
        results_page.fill_verdict(partial, tables.fill(partial, recorded(partial, runs)))
        == "79.50 ± 0.71 (2 of 3 seeds); −1.50 ± 0.71 (2 of 3 seeds); −1.50 ± 0.71 (2 of 3 seeds); 82.00 ±"
        " 2.00"
    )
    saved = {**SPEC, "verdict": "{saved:bspf_demo:demo:top1}"}  # 1 − 81 / 82 of the means
    assert results_page.fill_verdict(saved, tables.fill(saved, recorded(saved, _runs()))) == "1"
    assert results_page.fill_verdict(spec, tables.fill(spec, [])).startswith("not run; not run; not run")
    ratio = {**SPEC, "verdict": "{ratio:bspf_demo:demo:top1}"}  # 81 / 82 − 1 of the means
    assert results_page.fill_verdict(ratio, tables.fill(ratio, recorded(ratio, _runs()))) == "−1.22 %"


def test_a_row_label_states_a_measured_ratio():
    """A label's placeholders are filled by tables.fill, so an equal-cost setting names its measured ratio."""
    spec = {
        **SPEC,
        "rows": [
            SPEC["rows"][0],
            {**SPEC["rows"][1], "label": "method ({ratio:bspf_demo:demo:top1} of base)"},
        ],
    }
    rows = tables.fill(spec, recorded(spec, _runs()))
    assert rows[1]["label"] == "method (−1.22 % of base)" and rows[0]["label"] == "base"


@pytest.mark.parametrize(
    "verdict,complaint",
    [
        ("{cell:nope:top1}", "row 'nope'"),
        ("{cell:demo:acc}", "column 'acc'"),
        ("{delta:demo:top1}", "paired column"),
        ("{diff:demo:top1}", "ROW_A:ROW_B:COL"),
    ],
)
def test_a_placeholder_the_table_cannot_fill_is_refused(verdict, complaint):
    spec = {**SPEC, "verdict": verdict}
    with pytest.raises(ValueError, match=re.escape(complaint)):
        results_page.fill_verdict(spec, tables.fill(spec, recorded(spec, _runs())))


@pytest.mark.parametrize("name", VERDICTS)
def test_every_verdict_fills_from_its_table(name):
    spec = tables.load_spec(name)
    assert results_page.verdict_errors(spec, tables.fill(spec, [])) == []


def hand_typed(verdict: str) -> list[str]:
    """Measured-looking numbers outside placeholders and outside "(paper: ...)" segments."""
    text = results_page.PLACEHOLDER.sub("", " ".join(verdict.split()))
    for mark in results_page.HAND_MARKS:
        text = re.sub(re.escape(mark) + r"[^()]*(\([^()]*\)[^()]*)*\)", "", text)
    return MEASURED.findall(text)


@pytest.mark.parametrize("name", VERDICTS)
def test_no_verdict_types_a_measured_number(name):
    assert hand_typed(str(tables.load_spec(name)["verdict"])) == []


def test_the_check_finds_a_typed_number():
    assert hand_typed("BSPF-ViT scores 86.15 ± 0.12, Δ −2.64 at 0.0104 GMACs") == [
        "86.15 ±",
        "0.12",
        "Δ −2",
        "0.0104",
    ]
    assert hand_typed("the teacher scores 87.28 %") == ["87.28 %"]
    assert hand_typed("BSPF-ViT reaches 81.4 against 79.8 at keep 0.5, r = 11, k = 6") == ["81.4", "79.8"]
    assert hand_typed("(paper: 81.8 % against 79.8 %) {cell:a:b} {saved:a:b:c} % at keep 0.45") == []
    assert hand_typed("(computed by hand from runs: Δ −2.52), 9–17 % saved, 0.65 of 0.75 GMACs") == [
        "Δ −2",
        "17 %",
        "0.65",
        "0.75",
    ]


def test_vitexp_tables_writes_the_page(tmp_path):
    from vitexp.cost.render import DOCS_PAGE

    page = tmp_path / "results.md"
    out = tmp_path / "tables"
    cluster_page = DOCS_PAGE.read_bytes()
    assert (
        tables.main(
            [
                "fmnist_bspf_table6",
                "--results-dir",
                str(tmp_path),
                "--out",
                str(out),
                "--results-page",
                str(page),
            ]
        )
        == 0
    )
    assert DOCS_PAGE.read_bytes() == cluster_page  # another ledger's costs never reach docs/cluster.md
    text = page.read_text()
    assert text.startswith("<!-- Generated by vitexp-tables")
    assert (
        "## BSPF-ViT Table 6, micro edition" in text
        and "[table](../results/tables/fmnist_bspf_table6.md)" in text
    )
    assert "single-token score not run (Δ not run)" in text  # an empty ledger: every placeholder says so
    assert "no table written yet" in text  # the tables this call did not write are not linked
    # the claim-by-claim table across protocols is on the page, whole, with its verdict column
    assert (
        "## BSPF-ViT's claims under four protocols" in text
        and "(sweeps/verdicts/fmnist_bspf_protocols.yaml)" not in text
    )
    assert (
        "`sweeps/verdicts/fmnist_bspf_protocols.yaml` → [table](../results/tables/fmnist_bspf_protocols.md)"
        in text
    )
    assert (
        "| BSPF-ViT (keep 0.5) beats full attention (bspf − full) | not run | not run | not run | not run |"
        " not run | not run (0 of 4" in text
    )


def test_the_page_is_written_by_default_only_from_the_projects_own_ledger(tmp_path):
    from vitexp import PROJECT_ROOT

    own = PROJECT_ROOT / "results"
    assert results_page.default_page(own, own / "tables", False) == PROJECT_ROOT / "docs" / "results.md"
    assert results_page.default_page(own, own / "tables", True) is None  # --ledger, --wandb or overrides
    assert (
        results_page.default_page(tmp_path, tmp_path / "tables", False) is None
    )  # a test's, a user's ledger
    assert results_page.default_page(own, tmp_path, False) is None
