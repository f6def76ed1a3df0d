"""A method's claims under several protocols (vitexp.report.protocols): the sign rule, the verdict only
where protocols agree, and the committed verdict table regenerated from the committed ledger."""

from __future__ import annotations

import pytest

from vitexp import PROJECT_ROOT
from vitexp.config import rows
from vitexp.ledger import Ledger
from vitexp.report import protocols, tables, verdict_rule


def _row(name: str, seeds: dict[int, float]) -> dict:
    return {"experiment": name, "cells": {"top1": {"seeds": seeds}}}


SPEC = {
    "title": "t",
    "key": "top1",
    "digits": 2,
    "protocols": [
        {"label": "P1", "rows": {"full": "t1:full", "m": "t1:m"}},
        {"label": "P2", "rows": {"full": "t2:full", "m": "t2:m"}},
        {"label": "P3", "rows": {"full": "t3:full", "m": "t3:m"}},
    ],
    "claims": [{"label": "m beats full", "a": "m", "b": "full"}],
}


def test_the_sign_rule_and_a_verdict_only_where_the_protocols_agree():
    assert [verdict_rule.sign(p) for p in ([0.1, 0.2], [-0.1, -0.3], [0.2, -0.1], [])] == [
        "supports",
        "contradicts",
        "undecided",
        "not run",
    ]
    assert (
        verdict_rule.sign([0.1, 0.2], needed=3) == "incomplete"
        and verdict_rule.sign([0.1, 0.2, 0.3], needed=3) == "supports"
    )
    filled = {
        "t1": [_row("full", {0: 80.0, 1: 81.0, 2: 82.0}), _row("m", {0: 81.0, 1: 81.5, 2: 82.2})],
        "t2": [_row("full", {0: 80.0, 1: 81.0}), _row("m", {0: 79.0, 1: 80.0, 2: 70.0})],
        "t3": [_row("full", {}), _row("m", {})],
    }
    (claim,) = protocols.evaluate(SPEC, filled.__getitem__)
    assert [c["text"] for c in claim["cells"]] == ["+0.57 ± 0.40 (3)", "-1.00 ± 0.00 (2)", "not run"]
    assert (
        claim["verdict"]
        == "protocols disagree: supports under P1; contradicts under P2 (2 of 3 protocols measured)"
    )
    filled["t2"][1]["cells"]["top1"]["seeds"] = {0: 80.5, 1: 81.1}
    (claim,) = protocols.evaluate(SPEC, filled.__getitem__)
    assert claim["verdict"] == "holds under every measured protocol so far (2 of 3 protocols measured)"
    (claim,) = protocols.evaluate({**SPEC, "protocols": SPEC["protocols"][:1]}, filled.__getitem__)
    assert (
        claim["verdict"] == "holds under every measured protocol (1 of 1 protocols measured)"
    )  # nothing to come
    needs3 = {**SPEC, "pairs": 3}  # P2's two pairs are too few: shown, not judged
    (claim,) = protocols.evaluate(needs3, filled.__getitem__)
    assert [c["sign"] for c in claim["cells"]] == ["supports", "incomplete", "not run"]
    assert (
        claim["verdict"]
        == "holds under every measured protocol so far (1 of 3 protocols measured, 1 incomplete); "
        "not yet judged: P2: +0.30 ± 0.28 (2)"
    )
    assert (
        "| +0.57 ± 0.40 (3) (supports) | +0.30 ± 0.28 (2) (incomplete: 2 of 3 pairs; supports so far) | not"
        " run |" in protocols.render(needs3, [claim])
    )


def test_a_claim_may_judge_its_own_column_and_the_columns_may_be_backbones():
    """Claims on two columns of one table (AP box, AP mask), judged per backbone: each cell reads
    its claim's column, and the verdict speaks of backbones."""

    def row(name, box, mask):
        return {"experiment": name, "cells": {"ap_box": {"seeds": box}, "ap_mask": {"seeds": mask}}}

    spec = {
        "title": "t",
        "key": "ap_box",
        "digits": 1,
        "column": "backbone",
        "protocols": [
            {"label": "B1", "rows": {"plain": "t:p1", "m": "t:m1"}},
            {"label": "B2", "rows": {"plain": "t:p2", "m": "t:m2"}},
        ],
        "claims": [
            {"label": "box", "a": "m", "b": "plain", "key": "ap_box"},
            {"label": "mask", "a": "m", "b": "plain", "key": "ap_mask"},
        ],
    }
    filled = [
        row("p1", {0: 30.0, 1: 31.0}, {0: 20.0, 1: 21.0}),
        row("m1", {0: 31.0, 1: 32.0}, {0: 19.0, 1: 20.0}),
        row("p2", {0: 30.0, 1: 31.0}, {0: 20.0, 1: 21.0}),
        row("m2", {0: 30.5, 1: 31.5}, {0: 21.0, 1: 20.0}),
    ]
    box, mask = protocols.evaluate(spec, lambda t: filled)
    assert [c["text"] for c in box["cells"]] == ["+1.0 ± 0.0 (2)", "+0.5 ± 0.0 (2)"]
    assert box["verdict"] == "holds under every measured backbone (2 of 2 backbones measured)"
    assert [c["sign"] for c in mask["cells"]] == ["contradicts", "undecided"]  # B2's pairs: +1, −1
    assert (
        mask["verdict"]
        == "backbones disagree: contradicts under B1; undecided under B2 (2 of 2 backbones measured)"
    )
    assert "Backbones (rows from the tables named):" in protocols.render(spec, [box, mask])


def _run(run_id: str, fit: float, start: str | None = None, threads: int | None = None) -> dict:
    return {
        "run_id": run_id,
        "experiment": run_id,
        "kind": "train",
        "status": "completed",
        "config": {"name": run_id, "backbone": {"pretrained": f"run:{start}" if start else None}},
        "metrics": {"fit_time_s": fit},
        "started": "2026-12-01T00:00:00+00:00",
        **({"env": {"cpu_threads": threads}} if threads else {}),
    }


def test_a_protocols_cost_sums_its_runs_and_their_starts_once_and_the_total_a_shared_run_once():
    failed = {
        "run_id": "f",
        "experiment": "m+seed=5",
        "kind": "train",
        "status": "failed",
        "config": {"name": "m"},
        "started": "2026-12-01T00:00:00+00:00",
        "finished": "2026-12-01T00:30:00+00:00",
    }  # no fit time: 30 min
    ledger = Ledger(
        [
            _run("s", 3600.0),
            _run("a0", 360.0, "s"),
            _run("a1", 360.0, "s", threads=2),
            _run("b0", 1800.0, "s", threads=1),
            _run("x", 7200.0),
            failed,
        ]
    )  # a1: 6 CPU-minutes x 2 threads
    cells = {
        "t1": [
            {"experiment": "full", "cells": {"top1": {"run_ids": ["a0", "a1"]}}},
            {"experiment": "m", "cells": {"top1": {"run_ids": ["b0"]}}},
        ],
        "t2": [{"experiment": "full", "cells": {"top1": {}}}, {"experiment": "m", "cells": {"top1": {}}}],
        "t3": [
            {"experiment": "full", "cells": {"top1": {"run_ids": ["x", "s"]}}},
            {"experiment": "m", "cells": {"top1": {"run_ids": []}}},
        ],
    }
    costs = protocols.cost(SPEC, cells.__getitem__, ledger)
    assert [(c["runs"], c["hours"]) for c in costs] == [
        (["a0", "a1", "b0", "s"], 1.8),
        ([], 0.0),
        (["s", "x"], 3.0),
    ]
    text = protocols.render(
        SPEC, protocols.evaluate(SPEC, lambda t: [_row("full", {}), _row("m", {})]), costs
    )
    assert [(round(c["spent_hours"], 2), c["failed"]) for c in costs] == [
        (2.3, ["f"]),
        (0.5, ["f"]),
        (3.5, ["f"]),
    ]
    assert (
        "| Cost: training, CPU-hours (time × the run's threads) | 1.80 h cited (4 runs); 2.30 h spent (5"
        " runs, 1 not completed) | not run | 3.00 h cited (2 runs); 3.50 h spent (3 runs, 1 not completed) |"
        " 3.80 h cited (5 runs); 4.30 h spent (6 runs, 1 not completed) in all |" in text
    )  # s once, the failed run once


def test_a_claim_holds_only_on_both_splits_and_a_protocol_may_ask_for_more_pairs():
    """Every test pair above zero is no support when validation is undecided (one split only); a protocol
    asking for 5 pairs shows its 3 with their sign so far and is not judged."""

    def row(name, test, val):
        return {"experiment": name, "cells": {"top1": {"seeds": test}, "val_top1": {"seeds": val}}}

    spec = {**SPEC, "val_key": "val_top1", "protocols": SPEC["protocols"][:2]}
    filled = {
        "t1": [
            row("full", {0: 80.0, 1: 81.0, 2: 82.0}, {0: 80.0, 1: 81.0, 2: 82.0}),
            row("m", {0: 81.0, 1: 81.5, 2: 82.2}, {0: 81.0, 1: 80.5, 2: 82.2}),
        ],  # val: +1, −0.5, +0.2
        "t2": [
            row("full", {0: 80.0, 1: 81.0, 2: 82.0}, {0: 80.0, 1: 81.0, 2: 82.0}),
            row("m", {0: 81.0, 1: 81.5, 2: 82.2}, {0: 81.0, 1: 81.5, 2: 82.2}),
        ],
    }
    (claim,) = protocols.evaluate(spec, filled.__getitem__)
    assert [c["sign"] for c in claim["cells"]] == ["one split only", "supports"]
    assert claim["cells"][0]["text"] == "test +0.57 ± 0.40 (3); val +0.23 ± 0.75 (3)"
    assert (
        claim["verdict"]
        == "protocols disagree: supports under P2; one split only (test supports, val undecided) under P1"
        " (2 of 2 protocols measured)"
    )
    assert (
        verdict_rule.both("supports", "supports") == "supports"
        and verdict_rule.both("contradicts", "undecided") == "one split only"
        and verdict_rule.both("supports", None) == "supports"
    )
    five = {**spec, "protocols": [{**spec["protocols"][0], "pairs": 5}, spec["protocols"][1]]}
    (claim,) = protocols.evaluate(five, filled.__getitem__)
    assert [c["sign"] for c in claim["cells"]] == ["incomplete", "supports"]
    assert "(incomplete: 3 of 5 pairs; one split only so far)" in protocols.render(five, [claim])
    assert claim["verdict"].startswith(
        "holds under every measured protocol so far (1 of 2 protocols measured, 1 incomplete)"
    )


def test_a_running_run_whose_process_died_is_spent_and_a_live_one_is_not():
    """The spent runs use the ledger's effective status: a ``running`` entry whose process is gone
    (stale heartbeat) counts as not completed, with its wall clock to its last heartbeat; a running
    entry whose process is alive (this one) is not spent yet."""
    import os
    import platform

    dead = {
        "run_id": "d",
        "experiment": "m+seed=7",
        "kind": "train",
        "status": "running",
        "config": {"name": "m"},
        "started": "2000-01-01T00:00:00+00:00",
        "heartbeat": "2000-01-01T00:45:00+00:00",
    }  # 45 min, long ago
    alive = {
        **dead,
        "run_id": "l",
        "experiment": "m+seed=8",
        "env": {"hostname": platform.node(), "pid": os.getpid()},
    }
    ledger = Ledger([_run("a0", 360.0), dead, alive])
    cells = {
        t: [
            {"experiment": "full", "cells": {"top1": {"run_ids": ["a0"] if t == "t1" else []}}},
            {"experiment": "m", "cells": {"top1": {}}},
        ]
        for t in ("t1", "t2", "t3")
    }
    first, *_ = protocols.cost(SPEC, cells.__getitem__, ledger)
    assert sorted(first["spent"]) == ["a0", "d"] and first["failed"] == ["d"]
    assert first["spent"]["d"] == 45 * 60.0 and round(first["spent_hours"], 2) == 0.85


def test_a_complete_test_split_without_validation_is_incomplete_and_never_judged():
    """Two splits: test complete while validation is not run (or has too few pairs) is incomplete, not a
    one-split verdict; it counts as not measured and the cell shows each split's count."""

    def row(name, test, val):
        return {"experiment": name, "cells": {"top1": {"seeds": test}, "val_top1": {"seeds": val}}}

    spec = {**SPEC, "val_key": "val_top1", "pairs": 3, "protocols": SPEC["protocols"][:2]}
    full = {0: 80.0, 1: 81.0, 2: 82.0}
    filled = {
        "t1": [row("full", full, full), row("m", {0: 81.0, 1: 82.0, 2: 83.0}, {})],  # val not run
        "t2": [row("full", full, full), row("m", {0: 81.0, 1: 82.0, 2: 83.0}, {0: 81.0})],
    }  # val: 1 of 3
    assert (
        verdict_rule.both("supports", "not run") == "incomplete"
        and verdict_rule.both("supports", "incomplete") == "incomplete"
    )
    (claim,) = protocols.evaluate(spec, filled.__getitem__)
    assert [c["sign"] for c in claim["cells"]] == ["incomplete", "incomplete"]
    assert claim["verdict"].startswith(
        "no protocol measured yet (0 of 2 protocols measured, 2 incomplete); not yet judged: "
        "P1: test +1.00 ± 0.00 (3); val not run"
    )
    md = protocols.render(spec, [claim])
    assert "| test +1.00 ± 0.00 (3); val not run (incomplete: test 3, val 0 of 3 pairs) |" in md
    assert "(incomplete: test 3, val 1 of 3 pairs; supports so far) |" in md


def test_test_support_with_validation_contradicting_is_split_dependent():
    def row(name, test, val):
        return {"experiment": name, "cells": {"top1": {"seeds": test}, "val_top1": {"seeds": val}}}

    spec = {**SPEC, "val_key": "val_top1", "protocols": SPEC["protocols"][:1]}
    full = {0: 80.0, 1: 81.0, 2: 82.0}
    filled = {
        "t1": [row("full", full, full), row("m", {0: 81.0, 1: 82.0, 2: 83.0}, {0: 79.0, 1: 80.0, 2: 81.0})]
    }
    assert (
        verdict_rule.both("supports", "contradicts")
        == "split-dependent"
        == verdict_rule.both("contradicts", "supports")
    )
    (claim,) = protocols.evaluate(spec, filled.__getitem__)
    assert (
        claim["cells"][0]["sign"] == "split-dependent" and claim["cells"][0]["val"]["sign"] == "contradicts"
    )
    assert (
        claim["verdict"] == "split-dependent (test supports, val contradicts) under every measured protocol"
        " (1 of 1 protocols measured)"
    )


def test_a_reference_protocol_is_shown_and_never_votes():
    """A protocol marked ``reference`` (runs a later protocol trains again) keeps its cell, says it is not
    counted, and neither its sign, its incompleteness nor its marks enter the verdict."""
    filled = {
        "t1": [_row("full", {0: 80.0, 1: 81.0, 2: 82.0}), _row("m", {0: 81.0, 1: 81.5, 2: 82.2})],
        "t2": [_row("full", {0: 80.0, 1: 81.0, 2: 82.0}), _row("m", {0: 79.0, 1: 80.5, 2: 81.0})],
        "t3": [_row("full", {0: 80.0}), _row("m", {0: 81.0})],
    }
    filled["t2"][1]["cells"]["top1"]["marks"] = "‡"
    spec = {
        **SPEC,
        "pairs": 3,
        "protocols": [
            SPEC["protocols"][0],
            {**SPEC["protocols"][1], "reference": "lost start"},
            {**SPEC["protocols"][2], "reference": "lost start"},
        ],
    }
    (claim,) = protocols.evaluate(spec, filled.__getitem__)
    assert [c["sign"] for c in claim["cells"]] == ["supports", "contradicts", "incomplete"]
    assert claim["verdict"] == "holds under every measured protocol (1 of 1 protocols measured)"
    table = protocols.render(spec, [claim])
    assert "-0.83 ± 0.29 (3) ‡ (contradicts; not counted)" in table
    assert "+1.00 (1) (incomplete: 1 of 3 pairs; supports so far; not counted)" in table
    assert "- **P2** (not counted: lost start): full = `t2:full`" in table
    from vitexp.report.protocol_prose import summary

    assert "P2: -0.83 ± 0.29 (3) ‡ (contradicts; not counted)" in summary(
        {**spec, "name": "n"}, [claim], [], []
    )


def test_a_reference_to_a_row_the_table_lacks_is_an_error():
    with pytest.raises(ValueError, match="t1:m: table t1 has no row recorded as 'm'"):
        protocols.evaluate(SPEC, lambda t: [_row("full", {0: 1.0})])


@pytest.mark.parametrize("name", protocols.verdict_files())
def test_every_verdict_names_rows_of_its_tables_and_regenerates_its_committed_table(name):
    spec = protocols.load(name)
    for proto in spec["protocols"]:
        for ref in protocols.all_refs(proto):
            table, row = ref.split(":")
            assert row in {
                rows.row_name(r)
                for r in rows.expand_rows(tables.load_spec(table)["rows"])
                if r.get("experiment")
            }, ref
    ledger = Ledger.load(PROJECT_ROOT / "results")
    fill = lambda t: tables.fill(tables.load_spec(t), ledger)  # noqa: E731
    text = protocols.text(name, fill, ledger, tables.load_spec)
    assert text == (PROJECT_ROOT / "results" / "tables" / f"{name}.md").read_text()
    from vitexp.report.protocol_prose import page_block  # the docs pages' blocks: the same prose

    assert all(block == protocols.prose(text) for block in page_block(spec).values()), "run vitexp-tables"


def test_a_cell_carries_the_marks_of_the_cells_it_pairs_and_the_verdict_says_where_it_rests_on_them():
    """A claim whose difference uses a ‡ run says so in its cell, in its verdict and in a note."""
    filled = {
        "t1": [_row("full", {0: 80.0, 1: 81.0, 2: 82.0}), _row("m", {0: 81.0, 1: 81.5, 2: 82.2})],
        "t2": [_row("full", {0: 80.0, 1: 81.0, 2: 82.0}), _row("m", {0: 81.0, 1: 81.5, 2: 82.2})],
        "t3": [_row("full", {}), _row("m", {})],
    }
    filled["t2"][1]["cells"]["top1"]["marks"] = "‡"
    filled["t3"][1]["cells"]["top1"]["marks"] = "‡"  # no pair: nothing rests on it
    (claim,) = protocols.evaluate(SPEC, filled.__getitem__)
    assert [c["text"] for c in claim["cells"]] == ["+0.57 ± 0.40 (3)", "+0.57 ± 0.40 (3) ‡", "not run"]
    assert (
        claim["verdict"] == "holds under every measured protocol so far (2 of 3 protocols measured); "
        "rests on marked runs under P2 (‡)"
    )
    assert "A mark after a cell is carried over" in protocols.render(SPEC, [claim])


#: The caveats the BSPF protocols verdict must state (issue 45): {what: phrases one caveat holds}.
BSPF_CAVEATS = {
    "the 14 x 14 grid duplicates pixels": ("upsampled 2 × by nearest neighbour", "every pixel duplicated"),
    "from scratch is 10 epochs, not 300": ("'From scratch' is the tier's 10-epoch", "paper: 300 epochs"),
    "the tested BSPF-ViT has separate Q/K": ("separate-Q/K variant, not the titular shared Q/K",),
    "10 pretraining epochs are a cost cap": ("Ten pretraining epochs are a cost cap",),
    "what carries the split dependence is open, start by start": (
        "What carries the 14 × 14 grid's split dependence",
        "one degree of freedom at the level of the start",
        "start_gaps",
        "fmnist_bspf_grid14_starts",
    ),
}


def test_the_bspf_verdict_states_its_caveats_from_its_source_in_its_committed_table():
    """Each caveat is one caveat of sweeps/verdicts/fmnist_bspf_protocols.yaml, and the committed table's
    caveats are exactly those generated from that file (so deleting one there fails here, before the
    table is regenerated, and a table edited by hand fails too)."""
    from vitexp.report.protocol_prose import caveats

    spec = protocols.load("fmnist_bspf_protocols")
    source = [" ".join(str(c["text"]).split()) for c in spec["caveats"]]
    ledger = Ledger.load(PROJECT_ROOT / "results")
    generated = caveats(spec, lambda t: tables.fill(tables.load_spec(t), ledger), tables.load_spec)
    committed = (PROJECT_ROOT / "results" / "tables" / "fmnist_bspf_protocols.md").read_text()
    listed = committed.split("\nCaveats:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert listed == [f"- {c}" for c in generated], "run vitexp-tables"
    for what, phrases in BSPF_CAVEATS.items():
        assert [i for i, text in enumerate(source) if all(p in text for p in phrases)], (
            f"the yaml lacks: {what}"
        )
        assert [c for c in generated if all(p in c for p in phrases)], f"the generated caveats lack: {what}"
