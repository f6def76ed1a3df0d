"""The verdict rule (vitexp.report.verdict_rule): each label from a constructed case, the start as the
unit of replication (pairs matched by start, statistics across starts), and one definition in the code
and in docs/verdicts.md."""

from __future__ import annotations

import re

import pytest

from vitexp import PROJECT_ROOT
from vitexp.report import protocols
from vitexp.report import verdict_rule as rule


@pytest.mark.parametrize(
    "pairs, label",
    [
        ([0.4, 0.1, 0.2], "supports"),
        ([-0.4, -0.1, -0.2], "contradicts"),
        ([-1.06, -0.18, 0.00], "none above zero"),  # SAPER kd k = 6 importance: no pair above zero
        ([0.0, 0.3, 0.1], "none below zero"),
        ([0.5, -0.1, 0.2], "undecided"),
        ([], "not run"),
    ],
)
def test_a_splits_sign_from_its_pairs(pairs, label):
    assert rule.sign(pairs) == label


@pytest.mark.parametrize(
    "test, val, label",
    [
        ("supports", "supports", "supports"),
        ("contradicts", "contradicts", "contradicts"),
        ("supports", "contradicts", "split-dependent"),  # opposite signs, each split decided
        ("contradicts", "supports", "split-dependent"),
        ("supports", "undecided", "one split only"),  # fusion on the 14 x 14 grid: test 5 of 5, val 4 of 5
        ("none above zero", "contradicts", "one split only"),
        ("undecided", "none above zero", "undecided"),
        ("none above zero", "none above zero", "none above zero"),
        ("supports", "not run", "incomplete"),
        ("incomplete", "supports", "incomplete"),
        ("supports", None, "supports"),
    ],
)
def test_a_protocols_label_from_its_two_splits(test, val, label):
    assert rule.both(test, val) == label


def test_the_95_percent_quantiles_are_students_t():
    from scipy.stats import t

    assert [round(t.ppf(0.975, df), 3) for df in range(1, 11)] == list(rule.T975)


def _cell(seeds: dict[int, float], start: str | None) -> dict:
    return {"seeds": seeds, "run_ids": [f"{start}/{s}" for s in sorted(seeds)]}


def _spec(**proto) -> dict:
    return {
        "title": "t",
        "key": "top1",
        "digits": 2,
        "protocols": [{"label": "P", **proto}],
        "claims": [{"label": "m beats full", "a": "m", "b": "full"}],
    }


def _start_of(run_id: str):
    start = run_id.split("/")[0]
    return None if start == "None" else f"run:{start}"


def _evaluate(spec: dict, rows: dict[str, tuple[dict, str | None]]):
    filled = [
        {"experiment": name, "cells": {"top1": _cell(seeds, start)}} for name, (seeds, start) in rows.items()
    ]
    (claim,) = protocols.evaluate(spec, lambda table: filled, _start_of)
    return claim["cells"][0]


THREE = {"full": ["t:full_s0", "t:full_s1", "t:full_s2"], "m": ["t:m_s0", "t:m_s1", "t:m_s2"]}
FULL = {0: 80.0, 1: 81.0, 2: 82.0}


def test_pairs_are_matched_by_start_and_the_spread_is_across_starts():
    """Three starts, 3 seeds each: a − b pairs only within a start (rows listed in any order), the cell
    shows the start means, their std (starts − 1 degrees of freedom) and the pooled std within."""
    rows = {
        "full_s0": (FULL, "A"),
        "full_s1": (FULL, "B"),
        "full_s2": (FULL, "C"),
        "m_s0": ({0: 81.0, 1: 82.0, 2: 83.0}, "A"),  # +1, +1, +1
        "m_s2": ({0: 80.5, 1: 81.5, 2: 82.5}, "C"),  # +0.5 each
        "m_s1": ({0: 80.2, 1: 81.1, 2: 82.3}, "B"),  # +0.2, +0.1, +0.3
    }
    spec = _spec(rows={**THREE, "m": ["t:m_s0", "t:m_s2", "t:m_s1"]}, starts=3, pairs=3)
    cell = _evaluate(spec, rows)
    assert cell["sign"] == "supports" and cell["starts"] == 3 and cell["n"] == 9
    assert [round(m, 6) for m in cell["stats"]["means"]] == [1.0, 0.2, 0.5]
    assert round(cell["mean"], 6) == round((1.0 + 0.2 + 0.5) / 3, 6)
    assert round(cell["std"], 4) == 0.4041  # across the three start means, not across the 9 pairs
    assert round(cell["stats"]["within"], 4) == round((0.02 / 6) ** 0.5, 4)
    assert round(cell["stats"]["half95"], 3) == round(4.303 * 0.40415 / 3**0.5, 3)
    assert cell["text"] == "+0.57 ± 0.40 across 3 starts (+1.00, +0.20, +0.50, ± 0.06 within; 9 pairs)"


def test_a_claim_holds_only_from_every_start():
    """Two starts support and one contradicts: undecided, though the pooled mean is above zero."""
    rows = {
        "full_s0": (FULL, "A"),
        "full_s1": (FULL, "B"),
        "full_s2": (FULL, "C"),
        "m_s0": ({0: 82.0, 1: 83.0, 2: 84.0}, "A"),
        "m_s1": ({0: 82.0, 1: 83.0, 2: 84.0}, "B"),
        "m_s2": ({0: 79.8, 1: 80.7, 2: 81.9}, "C"),
    }
    cell = _evaluate(_spec(rows=THREE, starts=3, pairs=3), rows)
    assert cell["mean"] > 0 and cell["sign"] == "undecided"


def test_too_few_starts_or_pairs_per_start_is_incomplete():
    rows = {
        "full_s0": (FULL, "A"),
        "full_s1": (FULL, "B"),
        "full_s2": ({}, "C"),
        "m_s0": ({0: 82.0, 1: 83.0, 2: 84.0}, "A"),
        "m_s1": ({0: 82.0, 1: 83.0, 2: 84.0}, "B"),
        "m_s2": ({}, "C"),
    }
    cell = _evaluate(_spec(rows=THREE, starts=3, pairs=3), rows)
    assert cell["sign"] == "incomplete" and cell["interim"] == "supports" and cell["starts"] == 2
    assert "(incomplete: 2 of 3 starts, 3 pairs each; supports so far)" in protocols.render(
        _spec(rows=THREE, starts=3, pairs=3), [{"claim": "c", "cells": [cell], "verdict": "v"}]
    )
    rows["m_s1"] = ({0: 82.0, 1: 83.0}, "B")  # a start with 2 of its 3 pairs
    rows["full_s2"], rows["m_s2"] = (FULL, "C"), ({0: 82.0, 1: 83.0, 2: 84.0}, "C")
    assert _evaluate(_spec(rows=THREE, starts=3, pairs=3), rows)["sign"] == "incomplete"
    rows["m_s1"] = ({0: 82.0, 1: 83.0, 2: 84.0}, "B")
    assert _evaluate(_spec(rows=THREE, starts=3, pairs=3), rows)["sign"] == "supports"


def test_rows_of_two_starts_are_never_paired_and_a_seed_from_nothing_is_its_own_start():
    rows = {"full_s0": (FULL, "A"), "m_s0": ({0: 81.0, 1: 82.0, 2: 83.0}, "B")}
    cell = _evaluate(_spec(rows={"full": "t:full_s0", "m": "t:m_s0"}), rows)
    assert cell["sign"] == "not run" and cell["n"] == 0  # same seeds, other starts: no pair
    rows = {"full_s0": (FULL, None), "m_s0": ({0: 81.0, 1: 82.0, 2: 83.0}, None)}
    cell = _evaluate(_spec(rows={"full": "t:full_s0", "m": "t:m_s0"}, starts=3), rows)
    assert cell["starts"] == 3 and cell["own_starts"] and cell["sign"] == "supports"
    assert cell["text"] == "+1.00 ± 0.00 (3 starts, a seed each)"
    cell = _evaluate(_spec(rows={"full": "t:full_s0", "m": "t:m_s0"}, starts=3, pairs=5), rows)
    assert cell["sign"] == "incomplete"  # from nothing, `pairs` counts the starts


def test_the_definitions_are_the_docs_and_the_tables_legend():
    """docs/verdicts.md states each label with the code's words; every claim table prints the legend."""
    page = (PROJECT_ROOT / "docs" / "verdicts.md").read_text()
    for label, words in rule.DEFINITIONS.items():
        assert re.search(rf"\*\*{re.escape(label)}\*\*: {re.escape(words)}", page), label
    legend = rule.legend(two_splits=True, starts=True)
    for label in ("none above zero", "split-dependent", "one split only"):
        assert f"{label}: {rule.DEFINITIONS[label]}" in legend
    md = protocols.render({**_spec(rows=THREE), "val_key": "val_top1"}, [])
    assert legend in md


def test_two_protocols_agree_on_a_one_split_label_only_where_their_splits_point_the_same_way():
    """A gain on validation only and a loss on validation only are both "one split only": the verdict
    names each with its direction instead of calling them agreement."""
    gain = rule.directed(rule.both("undecided", "supports"), "undecided", "supports")
    loss = rule.directed(rule.both("undecided", "contradicts"), "undecided", "contradicts")
    assert gain == "one split only (test undecided, val supports)" and gain != loss
    assert rule.verdict([("P1", gain), ("P2", loss)]).startswith("protocols disagree")
    assert rule.verdict([("P1", gain), ("P2", gain)]).startswith(
        "one split only (test undecided, val supports)"
    )
    assert rule.directed("supports", "supports", "supports") == "supports"


def test_two_rows_of_one_role_from_the_same_start_and_seed_are_refused():
    rows = {"full_a": (FULL, "A"), "full_b": (FULL, "A"), "m_s0": ({0: 81.0, 1: 82.0, 2: 83.0}, "A")}
    spec = _spec(rows={"full": ["t:full_a", "t:full_b"], "m": "t:m_s0"})
    with pytest.raises(ValueError, match="list one row per start"):
        _evaluate(spec, rows)


def test_an_incomplete_cell_counts_each_splits_starts_where_they_differ():
    """Three starts on the test split and two on validation: the cell says so, not "3 of 3 starts"."""
    cell = {
        "sign": "incomplete",
        "text": "t",
        "needed": 3,
        "needed_starts": 3,
        "starts": 3,
        "own_starts": False,
        "n": 9,
        "val": {"n": 6, "starts": 2, "sign": "incomplete"},
    }
    md = protocols.render(
        {**_spec(rows=THREE), "val_key": "val_top1"}, [{"claim": "c", "cells": [cell], "verdict": "v"}]
    )
    assert "(incomplete: test 3, val 2 of 3 starts, 3 pairs each)" in md


def test_a_start_the_ledger_cannot_resolve_is_named_in_the_cell():
    """``run:<experiment>`` that no completed run resolves (the run it loaded is not in the ledger) is
    an :class:`~vitexp.report.protocols.Unresolved` start; the cell says which, instead of keying the
    runs by the raw name in silence. A resolved start and a weights file stay as they were."""

    class StubLedger:
        runs = {
            "lost": {"config": {"backbone": {"pretrained": "run:teacher"}}},
            "found": {"config": {"backbone": {"pretrained": "run:teacher"}}},
            "tagged": {"config": {"backbone": {"pretrained": "deit_small.fb_in1k"}}},
        }

        def get(self, run_id):
            return self.runs.get(run_id)

        def start_of(self, run):
            return "teacher-20261201" if run is self.runs["found"] else None

    start_of = protocols.start_of_run(StubLedger())
    assert isinstance(start_of("lost"), protocols.Unresolved) and start_of("lost") == "run:teacher"
    assert start_of("found") == "run:teacher-20261201" and not isinstance(
        start_of("found"), protocols.Unresolved
    )
    assert start_of("tagged") == "deit_small.fb_in1k" and not isinstance(
        start_of("tagged"), protocols.Unresolved
    )
    cells = {True: protocols.Unresolved("run:teacher"), False: "run:teacher-20261201"}
    for unresolved, start in cells.items():
        a = [{"seeds": {0: 82.0, 1: 83.0}, "run_ids": ["a0", "a1"]}]
        b = [{"seeds": {0: 81.0, 1: 81.5}, "run_ids": ["b0", "b1"]}]
        got = protocols._pairs(a, b, 2, (1, 2), lambda run_id, start=start: start)
        assert ("run:teacher not found in the ledger" in got["text"]) is unresolved, got["text"]
        assert got["sign"] == "supports"
