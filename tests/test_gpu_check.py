"""scripts/gpu_check.sh's budget, without a GPU: ``--dry-run`` runs nothing and says, row by row, whether
the row's worst case fits in what is left of GPU_CHECK_BUDGET_S."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def dry_run(which: str, budget: int) -> list[tuple[str, int, int]]:
    """(would run | skipped, worst case s, seconds left) of each row."""
    done = subprocess.run(
        ["bash", str(SCRIPT), which, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPU_CHECK_BUDGET_S": str(budget), "OUT": "/nonexistent"},
    )
    assert done.returncode == 0, done.stderr
    rows = []
    for line in done.stdout.splitlines():
        if m := re.match(r"gpu_check: would run \(up to (\d+) s, (-?\d+) s left\)", line):
            rows.append(("run", int(m[1]), int(m[2])))
        elif m := re.match(r"gpu_check: skipped, needs up to (\d+) s, (-?\d+) s left", line):
            rows.append(("skip", int(m[1]), int(m[2])))
    return rows


@pytest.mark.parametrize("which", ["1", "2", "compile", "anchor", "rehearse"])
def test_no_row_starts_unless_its_worst_case_fits_the_budget_left(which):
    rows = dry_run(which, 400)
    assert rows, "the dry run listed no row"
    for what, worst, left in rows:
        assert (what == "run") == (worst <= left), (what, worst, left)
    spent = sum(worst for what, worst, _ in rows if what == "run")
    assert spent <= 400


def test_a_row_with_31_s_left_is_skipped():
    """The issue's case: 31 s of budget left and a row that may run 300 s."""
    first, *_ = dry_run("2", 31)
    assert first[0] == "skip" and first[2] == 31


def test_a_rehearsal_of_two_rows_counts_both_worst_cases():
    """saper_table1's DDP rehearsal runs two rows, each stopped at REHEARSE_ROW_S (150 s): its worst
    case is 300 s, so it does not start with 299 s left."""
    rows = dry_run("rehearse", 10_000)
    assert [worst for _, worst, _ in rows[:3]] == [150, 300, 150]
    skipped = dry_run("rehearse", 150 + 299)
    assert skipped[0][0] == "run" and skipped[1] == ("skip", 300, 299)


def test_the_compile_row_composes_on_this_machine():
    """Set 1's first row (``compile``): its overrides compose and type-check here, compile enabled, so
    the GPU's one call does not fail on its config."""
    import shlex

    import vitexp.config.composition as vconfig
    from vitexp.config.schema import check_types

    line = next(
        r
        for r in subprocess.run(
            ["bash", str(SCRIPT), "compile", "--dry-run"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "OUT": "/nonexistent"},
        ).stdout.splitlines()
        if "would run" in r
    )
    overrides = shlex.split(line.split(" bench ", 1)[1])
    cfg = vconfig.compose(overrides)
    check_types(cfg)
    assert cfg.compile.enabled and cfg.bench.amp and len(cfg.bench.compare) == 5
